"""The stop_gradient question at each length of training, side by side
(the confirmatory test once complete, the short protocol, the along protocol,
Table 1), from the committed results.json files alone.

  python -m capsnet.answer                  # study/answer.md and answer.json

Nothing is computed here that the protocols' own reports do not compute;
a missing or damaged protocol's results is named in one line and
study/answer.md left as it was (--protocols names the ones to show).
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.science import answer


def define_flags():
  flags.DEFINE_string("study", os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "study"), "the folder of confirm/, short/, along/ and table1/")
  flags.DEFINE_string("out", None, "where answer.md and answer.json go "
                      "(default: --study)")
  flags.DEFINE_list("protocols", list(answer.ANSWERED), "the protocols whose results the "
                    "answer puts side by side (leave one out only on purpose: a "
                    "missing one is an error)")


FLAGS = flags.FLAGS


def main(argv):
  del argv
  try:
    print(answer.write(FLAGS.study, FLAGS.out, tuple(FLAGS.protocols)))
  except ValueError as e:   # runs.RunError too: a damaged results.json, named
    sys.exit(f"answer: error: {e}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
