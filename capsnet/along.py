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
import sys

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import along


def define_flags():
  along.define_block_flags("along", first_seed=0, seeds=5)
  flags.DEFINE_string("precision", "fp32", "fp32 or bf16, for every run of the block")


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (tests: a small model)
  kept, seeds, publish = along.block_flags(FLAGS, "along")
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
