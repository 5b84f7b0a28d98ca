r"""Routing studies: trains and tests each variant of a grid with the same
seeds, then reports (`capsnet.science.report`, from the runs' files alone).

  python -m capsnet.study --epochs=1 --seeds=2              # stop_gradient grid
  python -m capsnet.study --grid=table1 --variants=r3_recon --epochs=50 \
      --precision=bf16 --out=$HOME/table1                   # one Table 1 run
  python -m capsnet.study --grid=table1 --out=$HOME/table1 --epochs=50 \
      --train=false --publish=study/table1                  # tabulate, copy
  python -m capsnet.study --epochs=1 --seeds=1 -- --train_size=2000   # train.py flags after --

Grids (`GRIDS`): `stop_gradient`, `table1`, `short` (docs/short.md) and
`multimnist`. Each run is a train.py run in <out>/<variant>[_decay<N>]_seed<k>/;
a finished run is skipped and an unfinished one resumes. The report
(results.md, results.json and plots) goes to --out, and with --publish also
there with each run's small files, never a checkpoint. The protocols and
their rules: docs/table1.md, docs/short.md.
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.data import affine
from capsnet.running import runs
from capsnet.science import grids
from capsnet.science import report


def define_flags():
  """The command-line flags; defined when run as a program only, so that
  importing this module (tests, other tools) adds no global flags."""
  flags.DEFINE_enum("grid", "stop_gradient", sorted(grids.GRIDS), "the grid of variants")
  flags.DEFINE_integer("epochs", None, "epochs per run (default: the grid's, else 1)",
                       lower_bound=1)
  flags.DEFINE_integer("seeds", None, "seeds per variant (first_seed ..; default: as many "
                       "as the grid declares, else 2)", lower_bound=1)
  flags.DEFINE_integer("first_seed", 0, "the first seed", lower_bound=0)
  flags.DEFINE_list("variants", None, "variants to run (default: the whole grid)")
  flags.DEFINE_list("decay_steps", None, "learning-rate decay periods (train.py "
                    "--decay_steps); each variant runs with each (default: the grid's)")
  flags.DEFINE_string("out", "study", "folder of the runs, table and plots")
  flags.DEFINE_string("publish", None, "also write the table and plots here and "
                      "copy each run's small files to <publish>/<run>/")
  flags.DEFINE_enum("precision", "fp32", ["fp32", "bf16"], "for every run")
  flags.DEFINE_integer("diag_every", 50, "steps between gradient diagnostics", lower_bound=1)
  flags.DEFINE_integer("val_every", 100, "steps between validations inside an epoch "
                       "(for the curves; 0: epoch ends only)", lower_bound=0)
  flags.DEFINE_bool("train", True, "run missing runs (false: only tabulate)")
  flags.DEFINE_list("compare", None, "paired comparisons A:B (B - A per seed, mean "
                    "and 95 percent t interval), e.g. r3_recon:r3_recon_nostop "
                    "(default: the grid's pairs)")
  flags.DEFINE_bool("routing", True, "after a run finishes, measure how far "
                    "routing moves the couplings (eval.py on its best checkpoint, "
                    "with its own and the other routing count): routing.json")
  flags.DEFINE_list("affine_sweep", [str(d) for d in grids.AFFINE_SWEEP], "--grid=short: "
                    "after a run finishes, score its best checkpoint on the affine "
                    "test set and on sets of these largest rotations (degrees): "
                    "affine_results.json; empty: no affine scoring")
  flags.DEFINE_string("shipped", os.path.join("pretrained", "r3_recon"), "--grid=short: "
                      "also score this run folder's best checkpoint on the affine "
                      "sets, into <out>/shipped/ (empty: not)")


FLAGS = flags.FLAGS


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py
  protocol = grids.GRIDS[FLAGS.grid]
  variants = FLAGS.variants or list(protocol.variants)
  unknown = [v for v in variants if v not in protocol.variants]
  if unknown:
    sys.exit(f"study: error: --variants: {unknown} not in the {protocol.name} "
             f"grid {list(protocol.variants)}")
  decays = FLAGS.decay_steps or [str(d) for d in protocol.schedules]
  try:
    schedules = [int(d) for d in decays]
  except ValueError:
    schedules = []
  if not schedules or min(schedules) < 1:
    sys.exit(f"study: error: --decay_steps={','.join(decays)}: expected positive integers")
  settings = {"epochs": FLAGS.epochs or protocol.epochs or 1,
              **{k: FLAGS[k].value for k in ("precision", "diag_every", "val_every")}}
  compare = (FLAGS.compare if FLAGS.compare is not None
             else [f"{a}:{b}" for a, b, _ in protocol.pairs])
  try:
    pairs = grids.parse_pairs(compare, protocol.variants)
    sweep = [int(d) if d == int(d) else d for d in affine.parse_sweep(FLAGS.affine_sweep)]
  except ValueError as e:
    sys.exit(f"study: error: {e}")
  seeds = range(FLAGS.first_seed, FLAGS.first_seed + (FLAGS.seeds or len(protocol.seeds) or 2))
  if not FLAGS.train and not any(
      os.path.isdir(report.run_dir(FLAGS.out, n, s, d)) for s in seeds for d in schedules
      for n in variants):   # checked before any scoring
    sys.exit(f"study: error: {FLAGS.out}: no run of the {FLAGS.grid} grid for seeds "
             f"{seeds.start}-{seeds.stop - 1} (expected folders such as "
             f"{report.run_name(variants[0], seeds.start, schedules[0])}/); a mistyped "
             "--out?")
  where = grids.Where(FLAGS.out, FLAGS.publish, FLAGS.train, FLAGS.routing, FLAGS.shipped)
  try:
    grids.run_grid(protocol, variants, seeds, schedules, settings, extra, pairs, sweep, where)
  except runs.RunError as e:   # a damaged file, named with its line
    sys.exit(f"study: error: {e}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
