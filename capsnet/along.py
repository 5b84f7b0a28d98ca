"""The stop_gradient question along training (docs/along.md): a block is
one seed's r1_recon, r3_recon and r3_recon_nostop, 10 epochs on the paper's
schedule, the weights kept at epochs 1, 2, 5 and 10 each scored on the test
and affine sets; the report computes the registered rule from the run files.

  python -m capsnet.along --first_seed=K --seeds=1 --out=$HOME/along   # block K
  python -m capsnet.along --seeds=5 --out=study/along --train=false   # the report
  python -m capsnet.along --seeds=1 --epochs=2 --kept=1,2 -- --train_size=2000  # a try

Each scored run's small files (never a checkpoint) are copied to --publish
with the report of every block published there; committing them is the
user's.
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import along
from capsnet.science import grids


def define_block_flags(name, first_seed, seeds, seed_help=""):
  """The flags of a command that runs and reports blocks of the along
  protocol (this one's and capsnet.confirm's), its runs in ~/<name> and
  published in study/<name>."""
  flags.DEFINE_integer("first_seed", first_seed, "the first block's seed" + seed_help,
                       lower_bound=0)
  flags.DEFINE_integer("seeds", seeds, "blocks to run, from --first_seed", lower_bound=1)
  flags.DEFINE_string("out", os.path.join(os.path.expanduser("~"), name),
                      "folder of the runs (checkpoints included) and the report")
  flags.DEFINE_string("publish", os.path.join(grids.ROOT, "study", name),
                      "copy each scored run's small files, and the report, here")
  flags.DEFINE_bool("train", True, "train and score missing runs (false: report only)")
  flags.DEFINE_integer("epochs", along.EPOCHS, "epochs a run (the protocol: 10; tests: fewer)",
                       lower_bound=1)
  flags.DEFINE_list("kept", [str(e) for e in along.KEPT], "the registered epochs "
                    "(the protocol: 1,2,5,10)")


def define_flags():
  define_block_flags("along", first_seed=0, seeds=5)
  flags.DEFINE_string("precision", "fp32", "fp32 or bf16, for every run of the block")


def block_flags(program):
  """(the registered epochs, the seeds, where to publish or None) from the
  block flags; exits naming a bad --kept."""
  try:
    kept = along.parse_kept(FLAGS.kept, FLAGS.epochs)
  except ValueError as e:
    sys.exit(f"{program}: error: {e}")
  return (kept, range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds),
          along.publish_folder(FLAGS.publish, FLAGS.out))


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (tests: a small model)
  kept, seeds, publish = block_flags("along")
  if FLAGS.precision not in ("fp32", "bf16"):
    sys.exit(f"along: error: --precision={FLAGS.precision}: expected fp32 or bf16")
  try:
    if FLAGS.train:
      along.run_blocks(FLAGS.out, seeds, FLAGS.precision, FLAGS.epochs, kept, publish, extra)
    found = along.collect(FLAGS.out, seeds, kept)
    if not found:
      sys.exit(f"along: error: {FLAGS.out}: no scored run of the protocol for seeds "
               f"{seeds.start}-{seeds.stop - 1} (expected <variant>_seed<k>/ folders "
               f"with {along.RESULTS_FILE}: {', '.join(along.VARIANTS)})")
    text = along.report(found, kept, FLAGS.out)
    if publish:    # every block published there, not only this command's
      along.report(along.with_published(found, publish, kept), kept, publish)
  except runs.RunError as e:
    sys.exit(f"along: error: {e}")
  print(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
