"""A registered protocol's command line (docs/studies.md), for any declaration
with a lock file; `python -m capsnet.confirm` is the confirmatory test's.

  python -m capsnet.registered --protocol=confirm --out=$HOME/confirm --publish=PATH
  python -m capsnet.registered --protocol=confirm --train=false --out=study/confirm
  python -m capsnet.registered --protocol=confirm --power   # the power computation
  python -m capsnet.registered --protocol=confirm --order   # the order table
  python -m capsnet.registered --protocol=confirm --audit   # the published runs

Running resumes the part-way run where the rule allows, else restarts or
starts the run due, and goes on through the sequence (--runs: how many to
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
from capsnet.science import grids
from capsnet.science import protocols
from capsnet.science import registered
from capsnet.science import rule

FLAGS = flags.FLAGS


def define_flags(protocol=None):
  """The flags; `protocol` given: its command alone (no --protocol)."""
  if protocol is None:
    names = [p.name for p in protocols.PROTOCOLS.values() if p.lock]
    flags.DEFINE_enum("protocol", names[0], names, "the registered protocol")
  default = protocol or protocols.PROTOCOLS[FLAGS["protocol"].default]
  flags.DEFINE_string("out", None, "folder of the runs (checkpoints included; default "
                      "~/<protocol>)")
  flags.DEFINE_string("publish", None, "the committed copy (default study/<protocol>): "
                      "each run's small files and scorings as it ends, the part-way "
                      "states and the report")
  flags.DEFINE_bool("train", True, "run the sequence (false: the report of --out only)")
  flags.DEFINE_integer("runs", None, "end this many runs, then stop (default: every "
                       "run left)", lower_bound=1)
  flags.DEFINE_bool("restart", False, "run the due run again whole, in a fresh folder, "
                    "where the rule says so (its folder gone, or another host identity); "
                    "without it the command refuses")
  flags.DEFINE_integer("epochs", None, f"epochs a run (registered: {default.epochs}; only "
                       f"a test run, {registered.UNCHECKED}=1, may change it)",
                       lower_bound=1)
  flags.DEFINE_list("kept", None, "the kept epochs (registered: "
                    f"{','.join(map(str, default.kept))}; only a test run may change them)")
  flags.DEFINE_bool("power", False, "print the registered power computation from the "
                    "pilot's committed runs and exit")
  flags.DEFINE_bool("order", False, "print the registered order table and exit")
  flags.DEFINE_bool("audit", False, "check the runs published in --publish against the "
                    "registration; exit 1 naming each breach")


def main(argv, declared=None):
  protocol = declared or protocols.PROTOCOLS[FLAGS.protocol]
  name = protocol.name
  extra = argv[1:]     # everything after `--` goes to train.py (test runs: a small model)
  epochs = FLAGS.epochs or protocol.epochs
  kept_values = FLAGS.kept or [str(e) for e in protocol.kept]
  out = FLAGS.out or os.path.join(os.path.expanduser("~"), name)
  publish = FLAGS.publish or os.path.join(grids.ROOT, "study", name)
  if FLAGS.train and registered.checked():
    fixed = {"--epochs": (str(epochs), str(protocol.epochs)),
             "--kept": (",".join(kept_values), ",".join(map(str, protocol.kept))),
             "-- (train.py's flags)": (" ".join(extra), "")}
    for flag, (value, expected) in fixed.items():
      if value != expected:
        sys.exit(f"{name}: error: {flag}={value}: the registration fixes "
                 f"{expected or 'none'}")
  try:
    kept = blocks.parse_kept(kept_values, epochs)
  except ValueError as e:
    sys.exit(f"{name}: error: {e}")
  protocol = dataclasses.replace(protocol, epochs=epochs, kept=kept)
  if FLAGS.order:
    print("\n".join(registered.table_lines(protocol)))
    return
  if FLAGS.audit:
    return audit(protocol, publish)
  if FLAGS.power:
    pilot, folder = rule.pilot_of(protocol)
    if pilot is None:
      sys.exit(f"{name}: error: --power: the protocol names no pilot")
    try:
      _, pilot_found = blocks.collect(folder, pilot.seeds, protocol).complete(protocol)
      print("\n".join(rule.power_lines(pilot_found, protocol)))
    except (ValueError, runs.RunError) as e:
      sys.exit(f"{name}: error: {folder}: {e}")
    return
  if not FLAGS.train:
    if not os.path.isdir(out):
      sys.exit(f"{name}: error: --out={out}: no such folder (expected the "
               "protocol's runs, <variant>_seed<k>/)")
    try:
      print(rule.report(out, protocol, out))
    except (runs.RunError, registered.RegisteredError) as e:
      sys.exit(f"{name}: error: {e}")
    return
  try:
    status = registered.run_sequence(protocol, out, publish, extra, FLAGS.runs,
                                     FLAGS.restart)
    if status == 0:
      print(rule.report(publish, protocol, publish))
  except (runs.RunError, registered.RegisteredError, OSError) as e:
    sys.exit(f"{name}: error: {e}")
  sys.exit(status)


def audit(protocol, publish):
  """--audit: one line a breach and exit 1, or one line saying what passed."""
  name = protocol.name
  commit = registered.registration_commit(grids.ROOT, protocol.lock)
  if commit is None:
    sys.exit(f"{name}: error: {grids.ROOT}: no git history that adds {protocol.lock}")
  page_path = os.path.join("docs", f"{name}.md")
  with open(os.path.join(grids.ROOT, page_path)) as f:
    page = f.read()
  registered_page = subprocess.run(["git", "show", f"{commit}:{page_path}"], cwd=grids.ROOT,
                                   capture_output=True, text=True).stdout
  breaches = registered.audit(protocol, publish, commit, page, registered_page)
  for line in breaches:
    print(f"{name}: audit: {line}", file=sys.stderr)
  if breaches:
    sys.exit(1)
  done, _ = registered.progress(protocol, publish)
  print(f"{name}: audit: {len(done)} of {len(registered.sequence(protocol))} runs "
        f"published, in turn, each attempt checked at {commit[:12]}: no breach")


def run(protocol=None):
  """The command line of `protocol` (None: --protocol names it)."""
  define_flags(protocol)
  app.run(lambda argv: main(argv, protocol))


if __name__ == "__main__":
  run()
