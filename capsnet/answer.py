"""The stop_gradient question at each length of training, in one place
(issue 41): what each protocol calls, and how far routing moves the
couplings there, from the committed results.json files alone.

  python -m capsnet.answer                  # study/answer.md and answer.json

Rows, shortest training first: the short protocol (5 epochs on a schedule
compressed to a learning-rate sum under one epoch, the best-validation
checkpoint; docs/short.md), the protocol along training (the weights at the
end of epochs 1, 2, 5 and 10 of the paper's schedule, no selection;
docs/along.md) and the 50-epoch Table 1 rows (the paper's schedule, the
best-validation checkpoint, one or two seeds; docs/table1.md). Each cell is
a pair's paired difference B - A over the blocks or seeds that have both
runs: its mean, its 95% t interval where n > 1, in bold where the interval
excludes zero (each protocol's rule: `stats.paired_difference`). Nothing is
computed here that the protocols' own reports do not compute; this module
puts their figures side by side. Writing the same files again writes the
same bytes.
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.science import answer


def define_flags():
  flags.DEFINE_string("study", os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "study"), "the folder of short/, along/ and table1/")
  flags.DEFINE_string("out", None, "where answer.md and answer.json go "
                      "(default: --study)")
  flags.DEFINE_list("protocols", list(answer.PROTOCOLS), "the protocols whose results the "
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
