"""The confirmatory test of the stop (docs/confirm.md, issue 53): sixteen
fresh blocks of the along-training protocol, fp32, from one commit.

  python -m capsnet.confirm --power                 # the registered power computation
  python -m capsnet.confirm --first_seed=K --out=$HOME/confirm   # block K (5 <= K <= 20)
  python -m capsnet.confirm --train=false --out=study/confirm    # the report

A block is capsnet.along's (one seed's `r1_recon`, `r3_recon` and
`r3_recon_nostop`, 10 epochs on the paper's schedule, each kept checkpoint
scored on the test and affine sets), always in fp32. The report
(results.md, results.json, confirm.png) is computed from the run files
alone: the registered primary comparison and its equivalence test, the
Holm-corrected secondary pair and the claim's verdict, the descriptive
tables, the 21 blocks pooled with the pilot's (study/along), the stop's
difference by host kind, and each block's host, commit and precision.
While blocks are missing it says "interim" in its first line and calls
nothing.
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import along
from capsnet.science import confirm
from capsnet.science import grids


def define_flags():
  flags.DEFINE_integer("first_seed", confirm.SEEDS[0], "the first block's seed (registered: "
                       f"{confirm.SEEDS[0]}-{confirm.SEEDS[-1]})")
  flags.DEFINE_integer("seeds", 1, "blocks to run, from --first_seed", lower_bound=1)
  flags.DEFINE_string("out", os.path.join(os.path.expanduser("~"), "confirm"),
                      "folder of the runs (checkpoints included) and the report")
  flags.DEFINE_string("publish", os.path.join(grids.ROOT, "study", "confirm"),
                      "copy each scored run's small files, and the report, here")
  flags.DEFINE_bool("train", True, "train and score missing runs (false: report only)")
  flags.DEFINE_bool("power", False, "print the registered power computation from the "
                    "pilot's committed runs (study/along) and exit")
  flags.DEFINE_string("pilot", confirm.PILOT, "the pilot's published runs")
  flags.DEFINE_integer("epochs", along.EPOCHS, "epochs a run (the protocol: 10; tests: "
                       "fewer)", lower_bound=1)
  flags.DEFINE_list("kept", [str(e) for e in along.KEPT], "the registered epochs "
                    "(the protocol: 1,2,5,10)")


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (tests: a small model)
  try:
    kept = along.parse_kept(FLAGS.kept, FLAGS.epochs)
  except ValueError as e:
    sys.exit(f"confirm: error: {e}")
  if FLAGS.power:
    try:
      found = along.collect(FLAGS.pilot, confirm.PILOT_SEEDS, kept)
      _, pilot_found = along.complete_blocks(found, kept)
      print("\n".join(confirm.power_lines(pilot_found, kept)))
    except (ValueError, runs.RunError) as e:
      sys.exit(f"confirm: error: --pilot={FLAGS.pilot}: {e}")
    return
  seeds = range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds)
  if seeds.start < confirm.SEEDS[0] or seeds.stop - 1 > confirm.SEEDS[-1]:
    sys.exit(f"confirm: error: --first_seed={FLAGS.first_seed} --seeds={FLAGS.seeds}: "
             f"the registered seeds are {confirm.SEEDS[0]} to {confirm.SEEDS[-1]}")
  publish = along.publish_folder(FLAGS.publish, FLAGS.out)
  if not FLAGS.train and not os.path.isdir(FLAGS.out):
    sys.exit(f"confirm: error: --out={FLAGS.out}: no such folder (expected the "
             "protocol's runs, <variant>_seed<k>/)")
  try:
    if FLAGS.train:
      along.run_blocks(FLAGS.out, seeds, confirm.PRECISION, FLAGS.epochs, kept, publish, extra)
    text = confirm.report(FLAGS.out, kept, FLAGS.pilot, FLAGS.out)
    if publish:    # every block published there, not only this command's
      confirm.report(publish, kept, FLAGS.pilot, publish)
  except runs.RunError as e:
    sys.exit(f"confirm: error: {e}")
  print(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
