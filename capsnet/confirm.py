"""The confirmatory test of the stop (docs/confirm.md): sixteen fresh
blocks of the along protocol (capsnet/along.py), fp32, from one commit.

  python -m capsnet.confirm --power                 # the registered power computation
  python -m capsnet.confirm --fits=170              # does a block fit 170 minutes?
  python -m capsnet.confirm --first_seed=K --out=$HOME/confirm   # block K (5 <= K <= 20)
  python -m capsnet.confirm --train=false --out=study/confirm    # the report

The report (results.md, results.json, confirm.png) is computed from the run
files alone; while blocks are missing it says "interim" and calls nothing.
"""
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import along
from capsnet.science import confirm
from capsnet.science import grids


def define_flags():
  along.define_block_flags("confirm", confirm.SEEDS[0], 1, " (registered: "
                           f"{confirm.SEEDS[0]}-{confirm.SEEDS[-1]})")
  flags.DEFINE_bool("power", False, "print the registered power computation from the "
                    "pilot's committed runs (study/along) and exit")
  flags.DEFINE_string("pilot", confirm.PILOT, "the pilot's published runs")
  flags.DEFINE_float("fits", None, "the sitting's minutes left: run the registered "
                     "bench and say whether a block fits by the registered start rule "
                     "(exit 0: it does, 1: it does not)", lower_bound=0)


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (tests: a small model)
  kept, seeds, publish = along.block_flags(FLAGS, "confirm")
  if FLAGS.fits is not None:
    return fits(FLAGS.fits)
  if FLAGS.power:
    try:
      found = along.collect(FLAGS.pilot, confirm.PILOT_SEEDS, kept)
      _, pilot_found = along.complete_blocks(found, kept)
      print("\n".join(confirm.power_lines(pilot_found, kept)))
    except (ValueError, runs.RunError) as e:
      sys.exit(f"confirm: error: --pilot={FLAGS.pilot}: {e}")
    return
  if seeds.start < confirm.SEEDS[0] or seeds.stop - 1 > confirm.SEEDS[-1]:
    sys.exit(f"confirm: error: --first_seed={FLAGS.first_seed} --seeds={FLAGS.seeds}: "
             f"the registered seeds are {confirm.SEEDS[0]} to {confirm.SEEDS[-1]}")
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


def fits(minutes_left):
  """Runs the registered bench and applies the start rule (docs/confirm.md)."""
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "bench.json")
    rc = subprocess.call([sys.executable, "-m", "capsnet.bench", *confirm.START_BENCH,
                          f"--json={report}"], cwd=grids.ROOT)
    try:
      speed = confirm.bench_speed(runs.RunFolder(tmp).read_json("bench.json") or {})
    except (ValueError, runs.RunError) as e:
      sys.exit(f"confirm: error: the bench (exit {rc}): {e}")
  need = confirm.block_minutes(speed)
  verdict = "fits: start it" if need <= minutes_left else "does not fit: do not start it"
  print(f"confirm: {speed:.1f} images/s: a block takes {need:.0f} min by the registered "
        f"rule; {minutes_left:.0f} min left: {verdict}")
  sys.exit(0 if need <= minutes_left else 1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
