"""The stop_gradient question along training (docs/along.md; its blocks as
`protocols.ALONG` declares them); the report computes its rule from the run
files.

  python -m capsnet.along --first_seed=K --seeds=1 --out=$HOME/along   # block K
  python -m capsnet.along --seeds=5 --out=study/along --train=false   # the report
  python -m capsnet.along --seeds=1 --epochs=2 --kept=1,2 -- --train_size=2000  # a try

Each scored run's small files (never a checkpoint) and the report of every
block are published to --publish; committing them is the user's.
"""
import dataclasses
import os
import sys

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import along
from capsnet.science import blocks
from capsnet.science import grids
from capsnet.science import protocols

ALONG = protocols.ALONG


def define_flags():
  flags.DEFINE_integer("first_seed", ALONG.seeds[0], "the first block's seed", lower_bound=0)
  flags.DEFINE_integer("seeds", len(ALONG.seeds), "blocks to run, from --first_seed",
                       lower_bound=1)
  flags.DEFINE_string("out", os.path.join(os.path.expanduser("~"), ALONG.name),
                      "folder of the runs (checkpoints included) and the report")
  flags.DEFINE_string("publish", os.path.join(grids.ROOT, "study", ALONG.name),
                      "copy each scored run's small files, and the report, here")
  flags.DEFINE_bool("train", True, "train and score missing runs (false: report only)")
  flags.DEFINE_integer("epochs", ALONG.epochs, "epochs a run (the protocol: "
                       f"{ALONG.epochs}; tests: fewer)", lower_bound=1)
  flags.DEFINE_list("kept", [str(e) for e in ALONG.kept], "the registered epochs "
                    f"(the protocol: {','.join(map(str, ALONG.kept))})")
  flags.DEFINE_string("precision", "fp32", "fp32 or bf16, for every run of the block")


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (tests: a small model)
  try:
    kept = blocks.parse_kept(FLAGS.kept, FLAGS.epochs)
  except ValueError as e:
    sys.exit(f"along: error: {e}")
  if FLAGS.precision not in ("fp32", "bf16"):
    sys.exit(f"along: error: --precision={FLAGS.precision}: expected fp32 or bf16")
  protocol = dataclasses.replace(ALONG, epochs=FLAGS.epochs, kept=kept,
                                 precision=FLAGS.precision)
  seeds = range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds)
  publish = blocks.publish_folder(FLAGS.publish, FLAGS.out)
  try:
    if FLAGS.train:
      blocks.run_blocks(FLAGS.out, seeds, protocol, publish, extra)
    found = blocks.collect(FLAGS.out, seeds, protocol)
    if not found.runs:
      sys.exit(f"along: error: {FLAGS.out}: no scored run of the protocol for seeds "
               f"{seeds.start}-{seeds.stop - 1} (expected <variant>_seed<k>/ folders "
               f"with {blocks.RESULTS_FILE}: {', '.join(ALONG.variants)})")
    text = along.report(found, protocol, FLAGS.out)
    if publish:    # every block published there, not only this command's
      along.report(blocks.with_published(found, publish, protocol), protocol, publish)
  except runs.RunError as e:
    sys.exit(f"along: error: {e}")
  print(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
