"""The confirmatory test of the stop (docs/confirm.md): its 48 runs in one
registered sequence, fp32, from the registration commit, in the lock file's
environment.

  python -m capsnet.confirm --out=$HOME/confirm --publish=PATH/study/confirm   # the runs
  python -m capsnet.confirm --train=false --out=study/confirm    # the report
  python -m capsnet.confirm --power                 # the registered power computation
  python -m capsnet.confirm --order                 # the registered order table
  python -m capsnet.confirm --audit                 # the published runs against it

Running resumes the part-way run where the page's rule allows, else restarts
or starts the run due, and goes on through the sequence (--runs: how many to
end). A stop signal saves the run, records its part-way state in the
published folder and exits 128 + the signal. The report is computed from the
run files alone; while blocks are missing it shows progress only.
"""
import dataclasses
import os
import subprocess
import sys

from absl import app
from absl import flags

from capsnet.running import runs
from capsnet.science import blocks
from capsnet.science import confirm
from capsnet.science import confirm_audit
from capsnet.science import confirm_run
from capsnet.science import grids


def define_flags():
  flags.DEFINE_string("out", os.path.join(os.path.expanduser("~"), "confirm"),
                      "folder of the runs (checkpoints included)")
  flags.DEFINE_string("publish", os.path.join(grids.ROOT, "study", "confirm"),
                      "the committed copy: each run's small files and scorings as it "
                      "ends, the part-way states and the report")
  flags.DEFINE_bool("train", True, "run the sequence (false: the report of --out only)")
  flags.DEFINE_integer("runs", None, "end this many runs, then stop (default: every "
                       "run left)", lower_bound=1)
  flags.DEFINE_bool("restart", False, "run the due run again whole, in a fresh folder, "
                    "where the rule says so (its folder gone, or another host identity); "
                    "without it the command refuses")
  flags.DEFINE_integer("epochs", confirm.CONFIRM.epochs, "epochs a run (registered: 10; only a "
                       f"test run, {confirm_run.UNCHECKED}=1, may change it)", lower_bound=1)
  flags.DEFINE_list("kept", [str(e) for e in confirm.CONFIRM.kept], "the kept epochs (registered: "
                    "1,2,5,10; only a test run may change them)")
  flags.DEFINE_bool("power", False, "print the registered power computation from the "
                    "pilot's committed runs (study/along) and exit")
  flags.DEFINE_string("pilot", confirm.PILOT, "the pilot's published runs")
  flags.DEFINE_bool("order", False, "print the registered order table and exit")
  flags.DEFINE_bool("audit", False, "check the runs published in --publish against the "
                    "registration; exit 1 naming each breach")


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py (test runs: a small model)
  if FLAGS.train and confirm_run.checked():
    registered = {"--epochs": (str(FLAGS.epochs), str(confirm.CONFIRM.epochs)),
                  "--kept": (",".join(FLAGS.kept), ",".join(map(str, confirm.CONFIRM.kept))),
                  "-- (train.py's flags)": (" ".join(extra), "")}
    for flag, (value, expected) in registered.items():
      if value != expected:
        sys.exit(f"confirm: error: {flag}={value}: the registration fixes "
                 f"{expected or 'none'}")
  try:
    kept = blocks.parse_kept(FLAGS.kept, FLAGS.epochs)
  except ValueError as e:
    sys.exit(f"confirm: error: {e}")
  protocol = dataclasses.replace(confirm.CONFIRM, epochs=FLAGS.epochs, kept=kept)
  if FLAGS.order:
    print("\n".join(confirm.table_lines()))
    return
  if FLAGS.audit:
    return audit(FLAGS.publish)
  if FLAGS.power:
    try:
      found = blocks.collect(FLAGS.pilot, confirm.PILOT_SEEDS, protocol)
      _, pilot_found = blocks.complete_blocks(found, protocol)
      print("\n".join(confirm.power_lines(pilot_found, protocol)))
    except (ValueError, runs.RunError) as e:
      sys.exit(f"confirm: error: --pilot={FLAGS.pilot}: {e}")
    return
  if not FLAGS.train:
    if not os.path.isdir(FLAGS.out):
      sys.exit(f"confirm: error: --out={FLAGS.out}: no such folder (expected the "
               "protocol's runs, <variant>_seed<k>/)")
    try:
      print(confirm.report(FLAGS.out, protocol, FLAGS.pilot, FLAGS.out))
    except (runs.RunError, confirm_run.ConfirmError) as e:
      sys.exit(f"confirm: error: {e}")
    return
  settings = blocks.settings(protocol)
  try:
    status = confirm_run.run_sequence(FLAGS.out, FLAGS.publish, settings, extra, FLAGS.runs,
                                      FLAGS.restart)
    if status == 0:
      print(confirm.report(FLAGS.publish, protocol, FLAGS.pilot, FLAGS.publish))
  except (runs.RunError, confirm_run.ConfirmError, OSError) as e:
    sys.exit(f"confirm: error: {e}")
  sys.exit(status)


def audit(publish):
  """--audit: one line a breach and exit 1, or one line saying what passed."""
  registered = confirm_run.registration_commit(grids.ROOT)
  if registered is None:
    sys.exit(f"confirm: error: {grids.ROOT}: no git history that adds {confirm_run.LOCK}")
  with open(os.path.join(grids.ROOT, "docs", "confirm.md")) as f:
    page = f.read()
  registered_page = subprocess.run(["git", "show", f"{registered}:docs/confirm.md"],
                                   cwd=grids.ROOT, capture_output=True, text=True).stdout
  breaches = confirm_audit.audit(publish, registered, page, registered_page)
  for line in breaches:
    print(f"confirm: audit: {line}", file=sys.stderr)
  if breaches:
    sys.exit(1)
  done, _ = confirm.progress(publish)
  print(f"confirm: audit: {len(done)} of {len(confirm.sequence())} runs published, in "
        f"turn, each attempt checked at {registered[:12]}: no breach")


if __name__ == "__main__":
  define_flags()
  app.run(main)
