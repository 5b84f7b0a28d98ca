"""The stop_gradient question along training (docs/along.md, issue 41).

  python -m capsnet.along --first_seed=K --seeds=1 --precision=bf16 \
      --out=$HOME/along                  # block K: three runs, then their scorings
  python -m capsnet.along --seeds=5 --out=study/along --train=false   # the report
  python -m capsnet.along --seeds=1 --epochs=2 --kept=1,2 -- --train_size=2000  # a try

A block is one seed's three runs (`r1_recon`, `r3_recon`, `r3_recon_nostop`)
of 10 epochs on the paper's schedule, each a train.py run in
<out>/<variant>_seed<k>/ that keeps its weights at the end of the
registered epochs (1, 2, 5, 10; train.py --keep_epochs). Each kept
checkpoint is scored once on the test set and once on the affine test set
(eval.py), into the run's along_results.json, as soon as the run ends:
checkpoints do not survive a sitting. No checkpoint is chosen. Each run's
small files (config.json, metrics.jsonl, diagnostics.jsonl, host.json,
along_results.json, never a checkpoint) are copied to --publish
(study/along) as it is scored; committing them is the user's.

The report (results.md, results.json and along.png in --out for its
blocks, and in --publish, unless it is --out, for every block published
there, so that a block's command leaves the published report whole) is
computed from the run files alone: for each pair, measure and registered
epoch the paired difference over the blocks with its 95% t interval, a
call where the interval excludes zero, and a reversal where a pair and
measure is called on one side at an earlier registered epoch and on the
other at a later one. Publishing the same files again writes the same
bytes.
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import along
from capsnet.science import grids


def define_flags():
  flags.DEFINE_integer("seeds", 5, "blocks (seeds first_seed .. first_seed+seeds-1)",
                       lower_bound=1)
  flags.DEFINE_integer("first_seed", 0, "the first block's seed", lower_bound=0)
  flags.DEFINE_string("out", os.path.join(os.path.expanduser("~"), "along"),
                      "folder of the runs (checkpoints included) and the report")
  flags.DEFINE_string("publish", os.path.join(grids.ROOT, "study", "along"),
                      "copy each scored run's small files, and the report, here")
  flags.DEFINE_string("precision", "fp32", "fp32 or bf16, for every run of the block")
  flags.DEFINE_bool("train", True, "train and score missing runs (false: report only)")
  flags.DEFINE_integer("epochs", along.EPOCHS, "epochs a run (the protocol: 10; tests: fewer)",
                       lower_bound=1)
  flags.DEFINE_list("kept", [str(e) for e in along.KEPT], "the registered epochs "
                    "(the protocol: 1,2,5,10)")


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (tests: a small model)
  try:
    kept = along.parse_kept(FLAGS.kept, FLAGS.epochs)
  except ValueError as e:
    sys.exit(f"along: error: {e}")
  if FLAGS.precision not in ("fp32", "bf16"):
    sys.exit(f"along: error: --precision={FLAGS.precision}: expected fp32 or bf16")
  seeds = range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds)
  publish = along.publish_folder(FLAGS.publish, FLAGS.out)
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
