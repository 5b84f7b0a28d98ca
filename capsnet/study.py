"""Does stop_gradient in routing help? Trains and tests each routing variant.

  python -m capsnet.study --epochs=1 --seeds=2              # this machine
  python -m capsnet.study --epochs=50 --seeds=3             # the full study (GPU)
  python -m capsnet.study --epochs=1 --seeds=1 -- --train_size=2000   # train.py flags after --

Variants: r = 1 (the stop changes nothing there; tests/test_stop_gradient.py
proves it), and r = 2, 3 with stop_gradient on and off. Every variant runs
with the same seeds, hence the same initial weights, data order and
augmentation, the same split and the same budget; each run is a train.py
run in <out>/<variant>_seed<k>/ with the gradient diagnostic on. A finished
run (test_results.json written after the last epoch) is skipped, an unfinished
one resumes, so the study can be stopped and continued. At the end the study
writes <out>/results.md (the table) and <out>/val_error.png (validation error
against epoch for each variant).
"""
import io
import json
import os
import statistics
import subprocess
import sys

from absl import app
from absl import flags

from capsnet import files

VARIANTS = {           # name: (iter_routing, stop_gradient)
    "r1": (1, True),
    "r2_stop": (2, True),
    "r2_nostop": (2, False),
    "r3_stop": (3, True),
    "r3_nostop": (3, False),
}


def define_flags():
  """The command-line flags; defined when run as a program only, so that
  importing this module (tests, other tools) adds no global flags."""
  flags.DEFINE_integer("epochs", 1, "epochs per run", lower_bound=1)
  flags.DEFINE_integer("seeds", 2, "seeds per variant (0 .. seeds-1)", lower_bound=1)
  flags.DEFINE_list("variants", list(VARIANTS), "variants to run")
  flags.DEFINE_string("out", "study", "folder of the runs, table and plot")
  flags.DEFINE_string("precision", "fp32", "fp32 or bf16, for every run")
  flags.DEFINE_integer("diag_every", 50, "steps between gradient diagnostics", lower_bound=1)
  flags.DEFINE_integer("val_every", 100, "steps between validations inside an epoch "
                       "(for the curves)", lower_bound=0)
  flags.DEFINE_bool("train", True, "run missing runs (false: only tabulate)")


FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dir(out, variant, seed):
  return os.path.join(out, f"{variant}_seed{seed}")


def read_jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def is_complete(folder, epochs):
  """The run finished `epochs` epochs and scored its best checkpoint."""
  rows = read_jsonl(os.path.join(folder, "metrics.jsonl"))
  return (os.path.exists(os.path.join(folder, "test_results.json"))
          and any(r["epoch"] == epochs and "images_per_sec" in r for r in rows))


def train_command(variant, seed, folder, extra):
  iters, stop = VARIANTS[variant]
  return [sys.executable, os.path.join(ROOT, "train.py"),
          f"--iter_routing={iters}", f"--stop_gradient={stop}", f"--seed={seed}",
          f"--epochs={FLAGS.epochs}", f"--logdir={folder}",
          f"--precision={FLAGS.precision}", f"--diag_every={FLAGS.diag_every}",
          f"--val_every={FLAGS.val_every}", "--progress=false", *extra]


def summarize(out, variants, seeds, epochs):
  """Per-variant figures from the run folders (complete runs only)."""
  rows = []
  for name in variants:
    runs = [run_dir(out, name, s) for s in range(seeds)]
    runs = [r for r in runs if is_complete(r, epochs)]
    if not runs:
      continue
    tests = [json.load(open(os.path.join(r, "test_results.json")))["error_percent"]
             for r in runs]
    metrics = [read_jsonl(os.path.join(r, "metrics.jsonl")) for r in runs]
    best_val = [min(m["val_error_percent"] for m in ms if "val_error_percent" in m)
                for ms in metrics]
    speed = [m["images_per_sec"] for ms in metrics for m in ms if "images_per_sec" in m]
    diags = [read_jsonl(os.path.join(r, "diagnostics.jsonl")) for r in runs]
    diag = {}
    for key in ("digit_caps/weights", "conv1/weights"):
      diag[key] = (statistics.mean(d[0][key] for d in diags),
                   statistics.mean(d[-1][key] for d in diags))
    rows.append({
        "variant": name, "iter_routing": VARIANTS[name][0],
        "stop_gradient": VARIANTS[name][1], "seeds": len(runs), "epochs": epochs,
        "test_error_mean": statistics.mean(tests),
        "test_error_std": statistics.stdev(tests) if len(tests) > 1 else 0.0,
        "test_errors": tests, "best_val_error_mean": statistics.mean(best_val),
        "images_per_sec": statistics.mean(speed), "diag": diag,
        "curves": [[(m["epoch"], m["val_error_percent"]) for m in ms
                    if "val_error_percent" in m] for ms in metrics]})
  return rows


def markdown(rows):
  lines = [
      "| variant | r | stop_gradient | seeds | epochs | test error % (mean ± std) "
      "| per seed | best val error % | images/s | routing share of W grad, start → end "
      "| of conv1 grad |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    w0, w1 = r["diag"]["digit_caps/weights"]
    c0, c1 = r["diag"]["conv1/weights"]
    lines.append(
        f"| {r['variant']} | {r['iter_routing']} | "
        f"{'n/a' if r['iter_routing'] == 1 else r['stop_gradient']} | {r['seeds']} | "
        f"{r['epochs']} | {r['test_error_mean']:.3f} ± {r['test_error_std']:.3f} | "
        f"{', '.join(f'{e:.2f}' for e in r['test_errors'])} | "
        f"{r['best_val_error_mean']:.3f} | {r['images_per_sec']:.0f} | "
        f"{w0:.3g} → {w1:.3g} | {c0:.3g} → {c1:.3g} |")
  return "\n".join(lines) + "\n"


def plot(rows, path):
  """Validation error against epoch, one colour per variant, a line per seed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
  for k, r in enumerate(rows):
    colour = f"C{k}"
    for s, curve in enumerate(r["curves"]):
      xs, ys = zip(*curve)
      ax.plot(xs, ys, color=colour, marker="o", markersize=3, linewidth=1.2,
              linestyle="-" if s == 0 else "--",
              label=f"{r['variant']}" if s == 0 else None)
  ax.set_xlabel("epoch")
  ax.set_ylabel("validation error (%)")
  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(title="variant (solid: seed 0, dashed: others)", fontsize=8)
  ax.set_title("CapsNet on MNIST: routing variants")
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png")
  plt.close(fig)
  files.atomic_write(path, png.getvalue())


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py
  unknown = [v for v in FLAGS.variants if v not in VARIANTS]
  if unknown:
    sys.exit(f"study: error: --variants: {unknown} not in {list(VARIANTS)}")
  os.makedirs(FLAGS.out, exist_ok=True)
  for seed in range(FLAGS.seeds):
    for name in FLAGS.variants:
      folder = run_dir(FLAGS.out, name, seed)
      if is_complete(folder, FLAGS.epochs):
        print(f"{name} seed {seed}: complete, skipped")
        continue
      if not FLAGS.train:
        continue
      print(f"{name} seed {seed}: training in {folder}", flush=True)
      os.makedirs(folder, exist_ok=True)
      with open(folder + ".log", "a") as log:
        rc = subprocess.call(train_command(name, seed, folder, extra),
                             stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
      if rc:
        sys.exit(f"study: error: {name} seed {seed} failed (exit {rc}); "
                 f"see {folder}.log")
  rows = summarize(FLAGS.out, FLAGS.variants, FLAGS.seeds, FLAGS.epochs)
  table = markdown(rows)
  files.atomic_write(os.path.join(FLAGS.out, "results.md"), table)
  files.write_json(os.path.join(FLAGS.out, "results.json"), rows)
  if rows:
    plot(rows, os.path.join(FLAGS.out, "val_error.png"))
  print(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
