"""Evaluates a trained CapsNet on the test set, the validation split or the
affine test set.

  python eval.py --checkpoint logs/run              # best checkpoint of a logdir
  python eval.py --checkpoint logs/run --which=latest
  python eval.py --checkpoint logs/run/best/model.ckpt-21500 --iter_routing=5
  python eval.py --checkpoint logs/run --split=affine --affine_sweep=0,5,10,45
  python eval.py --checkpoint pretrained/r3_recon --conv_impl=auto   # planned here

The graph is rebuilt from the run's config.json (--iter_routing, --precision,
--conv_impl and --dtype override it) and computes the convolutions as the run
did, so its scores are reproduced; --conv_impl=auto plans them here for the
forward alone. Writes results.json, predictions.csv, reconstructions.png and
figure4.png (Figure 4 of the paper) to --out_dir (default
<logdir>/eval_<checkpoint>_r<r>_<split>/). More: docs/using.md.
"""
import dataclasses
import json
import os
import sys

from capsnet.running import startup

startup.import_tensorflow()   # before anything imports TensorFlow

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from capsnet.data import affine  # noqa: E402
from capsnet.data import tasks  # noqa: E402
from capsnet.model import fast_conv  # noqa: E402
from capsnet.model import network  # noqa: E402
from capsnet.running import evaluation  # noqa: E402
from capsnet.running import files  # noqa: E402
from capsnet.running import planner  # noqa: E402
from capsnet.running import runs  # noqa: E402
from capsnet.using import pictures  # noqa: E402
from capsnet.using import serving  # noqa: E402
import config  # noqa: E402

flag = config.flag


@dataclasses.dataclass(frozen=True)
class Settings(config.DataSettings):
  """eval.py's flags, read once in `main`; a field made by `flag` is its flag."""
  checkpoint: str = flag("string", None, "checkpoint prefix or training logdir")
  which: str = flag("enum", "best", "checkpoint of a logdir", enum_values=["best", "latest"])
  weights: str = flag("enum", "auto", "the raw weights, their moving average (runs with "
                      "--ema_decay), or auto: those that won the run's validation",
                      enum_values=list(runs.WEIGHTS))
  iter_routing: int = flag("integer", None, "override routing iterations", lower_bound=1)
  precision: str = flag("enum", None, "override the run's precision (e.g. score "
                        "bf16-trained weights in fp32)", enum_values=["fp32", "bf16"])
  conv_impl: str = flag("enum", None, "override how the convolutions are computed "
                        "(default: as the run computed them, so its own scores are "
                        "reproduced bit for bit); auto: the methods planned on this host "
                        "for the forward pass alone, the same function computed the "
                        "fastest way here", enum_values=list(fast_conv.IMPLS))
  dtype: str = flag("enum", None, "override the run's variable dtype (must be the "
                    "checkpoint's)", enum_values=["float32", "float64"])
  split: str = flag("enum", "test", "split to score; affine: the affine test set, each "
                    "test image once rotated, sheared, scaled and shifted in affNIST's "
                    "ranges at 28x28 (not the paper's 40x40 affNIST; docs/short.md)",
                    enum_values=["test", "validation", "affine"])
  batch_size: int = flag("integer", 500, "evaluation batch size", lower_bound=1)
  out_dir: str = flag("string", None, "output folder")   # None: <run>/eval_<ckpt>_r<r>_<split>
  device: str = flag("string", None, "model device (default /gpu:0 if present)")
  num_images: int = flag("integer", 16, "images in reconstructions.png", lower_bound=1)
  figure4_images: int = flag("integer", 3, "test images in figure4.png", lower_bound=1)
  dataset: str = flag("enum", None, config.DATASET_HELP + " (default: the one the run "
                      "trained on)", enum_values=config.DATASETS)
  images: tuple = flag("string", None, "instead of a split: classify these image files "
                       "(--images a.png b.jpg ...; any size, colour or grey), writing "
                       "<name>.png and <name>_routing.png for each to --out_dir")
  json: bool = flag("bool", False, "with --images: print the results as JSON")
  export_savedmodel: str = flag("string", None, "instead: write the model as a TensorFlow "
                                "SavedModel to this (new) folder")
  affine_sweep: tuple = flag("list", (), "with --split=affine: also score affine sets "
                             "whose largest rotation is each of these degrees (the other "
                             "ranges as affNIST's), e.g. 0,5,10,...,45")


def define_flags(fv=flags.FLAGS):
  """eval.py's flags, defined in `fv`: absl's global FLAGS when run as a
  program; tests give their own, beside train.py's (some names are shared)."""
  config.define_flags_of(Settings, fv)
  flags.mark_flag_as_required("checkpoint", flag_values=fv)


def main(argv, fv=flags.FLAGS):
  values = {f.name: fv[f.name].value for f in dataclasses.fields(Settings)}
  values["images"] = (values["images"], *argv[1:]) if values["images"] else ()
  values["affine_sweep"] = tuple(values["affine_sweep"])
  s = Settings(**values)
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)  # deprecations
  try:
    if len(argv) > 1 and not s.images:
      raise runs.RunError(f"unexpected arguments {argv[1:]} (image files go after "
                          "--images)")
    ckpt, run_dir = runs.resolve(s.checkpoint, s.which)
    cfg, train_settings = runs.RunFolder(run_dir).load_config()
    overrides = {k: getattr(s, k) for k in ("iter_routing", "precision", "dtype")
                 if getattr(s, k)}
    if s.conv_impl:   # the run's plan was for its own conv_impl
      overrides.update(conv_impl=s.conv_impl, conv_plan="")
    cfg = dataclasses.replace(cfg, **overrides)
    reason = runs.damage(ckpt)
    if reason:
      raise runs.RunError(f"{ckpt}: damaged checkpoint ({reason})")
    s = dataclasses.replace(s, device=config.resolve_device(s.device, "eval.py"))
    if s.conv_impl == "auto":   # every mode: the forward pass's plan on this host
      batch = min(s.batch_size, len(s.images)) if s.images else s.batch_size
      cfg, line = planner.plan_inference(cfg, batch, s.device)
      if line:
        print(line, file=sys.stderr, flush=True)
    if s.export_savedmodel:
      serving.export(cfg, ckpt, s.export_savedmodel, s.weights)
      print(f"wrote the SavedModel of {ckpt} to {s.export_savedmodel}")
    elif s.images:
      s = dataclasses.replace(s, out_dir=s.out_dir
                              or runs.RunFolder(run_dir).own_images_folder().path)
      make_writable_folder(s.out_dir)
      sys.exit(classify_files(cfg, ckpt, s))
    else:
      evaluate_split(cfg, ckpt, run_dir, train_settings, s)
  except ValueError as e:   # RunError, DataError, ModelConfig errors
    sys.exit(f"eval.py: error: {e}")
  except OSError as e:
    sys.exit(f"eval.py: error: {e.filename or s.out_dir}: {e.strerror or e}")


def evaluate_split(cfg, ckpt, run_dir, train_settings, s):
  """Scores the test (or validation) split of the run's data set."""
  dataset = s.dataset or train_settings.get("dataset", tasks.DEFAULT)
  val_size = train_settings.get("val_size", tasks.VAL_SIZE)
  if s.split == "validation" and not val_size:
    raise runs.RunError(f"--split=validation: {run_dir} was trained with "
                        "--val_size=0, so it has no validation split")
  task = tasks.get(dataset, train_settings.get("multimnist_shift"))
  sweep = affine_sweep(s)
  splits = task.load(s.data_dir or config.default_data_dir(dataset), val_size, s.download)
  if s.split == "affine":
    splits["affine"] = task.affine_split(splits)
    # A sweep's point at the set's own largest rotation is the set itself.
    sweep = [(deg, splits["affine"] if deg == affine.AFFNIST.rotation_deg
              else task.affine_split(splits, deg)) for deg in sweep]
  s = dataclasses.replace(s, dataset=dataset, out_dir=s.out_dir or runs.RunFolder(
      run_dir).eval_folder(ckpt, cfg.iter_routing, s.split).path)
  make_writable_folder(s.out_dir)
  evaluate(cfg, ckpt, task, splits[s.split], s, sweep)


def affine_sweep(s):
  """--affine_sweep's rotations in degrees. Raises: RunError for a value that
  is not a number in [0, 180] or a sweep without --split=affine."""
  if s.affine_sweep and s.split != "affine":
    raise runs.RunError(f"--affine_sweep={','.join(s.affine_sweep)}: needs --split=affine")
  try:
    return affine.parse_sweep(s.affine_sweep)
  except ValueError as e:
    raise runs.RunError(str(e)) from None


def classify_files(cfg, ckpt, s):
  """Classifies image files: a line (or JSON) and pictures each; a file that
  cannot be used gets one line on stderr. Returns the exit status (1 if any
  failed)."""
  images, names, failed = [], [], 0
  for path in s.images:
    try:
      images.append(pictures.preprocess(path))
      names.append(path)
    except pictures.ImageError as e:
      print(f"eval.py: error: {e}", file=sys.stderr)
      failed += 1
  results = serving.classify(cfg, ckpt, np.stack(images), s.weights) if images else None
  report = []
  for k, path in enumerate(names):
    r = {key: value[k] for key, value in results.items()}
    stem = os.path.join(s.out_dir, os.path.splitext(os.path.basename(path))[0])
    files.atomic_write(stem + ".png", pictures.encode_png(pictures.report(
        images[k][..., 0], r.get("reconstructions"), r["lengths"], r["classes"])))
    grids = pictures.routing_grids(r["couplings"], r["classes"], cfg.primary_size,
                                   cfg.primary_types)
    entropies = [float(e) for e in r["routing_entropy"]]
    files.atomic_write(stem + "_routing.png", pictures.encode_png(
        pictures.routing_figure(images[k][..., 0], grids, entropies,
                                (cfg.conv1_kernel, cfg.primary_kernel),
                                cfg.primary_stride)))
    report.append({"file": path, "class": int(r["classes"]),
                   "lengths": [round(float(x), 6) for x in r["lengths"]],
                   "routing_entropy": [round(e, 6) for e in entropies],
                   "pictures": [stem + ".png", stem + "_routing.png"]})
  if s.json:
    print(json.dumps(report, indent=2))
  for r in report if not s.json else []:
    print(f"{r['file']}: {r['class']}  lengths " + " ".join(
        f"{x:.3f}" for x in r["lengths"]))
  return 1 if failed else 0


def make_writable_folder(path):
  """Creates the output folder and writes a probe file in it, before any
  work. Raises: RunError naming the path."""
  try:
    os.makedirs(path, exist_ok=True)
    files.probe_writable(path)
  except OSError as e:
    raise runs.RunError(f"--out_dir={path}: cannot write there ({e.strerror})") from None


def evaluate(cfg, ckpt, task, split, s, sweep=()):
  """Scores a split of the `task`'s data (images, labels[, targets]) with the
  checkpoint, writes to s.out_dir and prints the report; `sweep` [(largest
  rotation, (images, labels))]: more affine sets, into "sweep"."""
  out_dir = s.out_dir
  images, labels = split[:2]
  with tf.Graph().as_default():
    ev = evaluation.build(cfg, s.batch_size, s.device, task, routing_stats=True)
    figure4 = None
    if cfg.use_decoder:
      v_in = tf.compat.v1.placeholder(ev.outputs.v.dtype, ev.outputs.v.shape)
      class_in = tf.compat.v1.placeholder(tf.int32, [None])
      figure4 = (v_in, class_in, network.decode(v_in, class_in, cfg))
    saver, weights = runs.model_saver(ckpt, tf.compat.v1.global_variables(), s.weights)
    with tf.compat.v1.Session(config=config.session_config([s.device])) as sess:
      saver.restore(sess, ckpt)
      res = evaluation.run(sess, ev, *split)
      result = dict(evaluation.summary(res), checkpoint=ckpt, dataset=s.dataset,
                    split=s.split, iter_routing=cfg.iter_routing, weights=weights,
                    routing_uniform_entropy=float(np.log(cfg.num_classes)))
      if s.split == "affine":
        result["affine"] = dict(dataclasses.asdict(affine.AFFNIST), seed=affine.SEED,
                                md5=affine.md5(images))
        result["sweep"] = [
            {"max_rotation_deg": deg,
             "error_percent": evaluation.run(sess, ev, *part)["error_percent"]}
            for deg, part in sweep]
      out = runs.EvalFolder(out_dir)
      out.write_results(result)
      out.write_predictions(np.asarray(labels), res["predictions"], res["lengths"])
      if task.pictures == "figure5" and cfg.use_decoder:
        write_figure5(sess, ev, split, os.path.join(out_dir, "figure5.png"))
      elif task.pictures == "figure4" and figure4 and cfg.image_channels == 1:
        write_pictures(sess, ev, figure4, images, labels, cfg, s, out_dir)
  print_report(result, out_dir)


def write_figure5(sess, ev, split, path, cases=6, scan=500):
  """figure5.png: the first `cases` correct and wrong pairs of the first
  `scan` (two rows: correct, then wrong)."""
  feed = {ev.images: split[0][:scan], ev.labels: split[1][:scan],
          ev.targets: split[2][:scan]}
  sess.run(ev.iterator.initializer, feed)
  parts = []
  while True:
    try:
      parts.append(sess.run([ev.batch_images, ev.outputs.reconstructions,
                             ev.outputs.predictions]))
    except tf.errors.OutOfRangeError:
      break
  inputs, recons, preds = (np.concatenate(p) for p in zip(*parts, strict=True))
  labels = split[1][:scan]
  correct = (np.sort(preds, 1) == np.sort(labels, 1)).all(axis=1)
  picked = list(np.flatnonzero(correct)[:cases]) + list(np.flatnonzero(~correct)[:cases])
  picture = pictures.figure5(inputs[picked, ..., 0], recons[picked], labels[picked],
                             preds[picked], per_row=cases)
  files.atomic_write(path, pictures.encode_png(picture))


def write_pictures(sess, ev, figure4, images, labels, cfg, s, out_dir):
  """reconstructions.png and figure4.png from the first test images; `figure4`:
  `network.decode`'s (v, class placeholders, images)."""
  n = max(s.num_images, s.figure4_images)
  sess.run(ev.iterator.initializer, {ev.images: images[:n], ev.labels: labels[:n]})
  inputs, recon, v, pred = sess.run([ev.batch_images, ev.outputs.reconstructions,
                                     ev.outputs.v, ev.outputs.predictions])
  size = cfg.image_size
  pairs = np.stack([inputs[:s.num_images, ..., 0],
                    recon[:s.num_images].reshape(-1, size, size)], axis=1)
  files.atomic_write(os.path.join(out_dir, "reconstructions.png"), pictures.encode_png(
      pictures.tile(pairs.reshape(-1, size, size), columns=8)))
  # Figure 4: for each image, 16 rows (dimensions) x 11 columns (perturbations).
  v_in, class_in, decoded = figure4
  blocks = []
  for k in range(s.figure4_images):
    caps = pictures.perturbed_capsules(v[k], pred[k])
    out = sess.run(decoded, {v_in: caps, class_in: np.full(len(caps), pred[k])})
    blocks.append(out.reshape(-1, size, size))
  files.atomic_write(os.path.join(out_dir, "figure4.png"),
                     pictures.encode_png(pictures.figure4(blocks)))


def print_report(result, out_dir):
  print(f"checkpoint: {result['checkpoint']}  (iter_routing={result['iter_routing']}, "
        f"{result['weights']} weights)")
  print(f"{result['split']}: {result['count']} images, accuracy {result['accuracy']:.4f}, "
        f"error {result['error_percent']:.2f}%")
  print(f"loss {result['loss']:.5f} (margin {result['margin_loss_mean']:.5f}, "
        f"reconstruction {result['recon_loss_mean']:.5f})")
  print("routing, per iteration: mean entropy of c " + " ".join(
      f"{e:.4f}" for e in result["routing_entropy"])
      + f" (uniform {result['routing_uniform_entropy']:.4f}), mean max c "
      + " ".join(f"{m:.4f}" for m in result["routing_max_c"]))
  if "at_least_one" in result:   # MultiMNIST
    print(f"both digits right: {result['accuracy']:.4f}, at least one right: "
          f"{result['at_least_one']:.4f}")
  else:
    print("per-class accuracy: " + " ".join(
        f"{k}:{a:.4f}" for k, a in enumerate(result["per_class_accuracy"])))
    print("confusion matrix (rows = label, columns = prediction):")
    for k, row in enumerate(result["confusion"]):
      print(f"  {k}: " + " ".join(f"{x:5d}" for x in row))
  for row in result.get("sweep", []):
    print(f"affine, largest rotation {row['max_rotation_deg']:g} degrees: error "
          f"{row['error_percent']:.2f}%")
  print(f"wrote {out_dir}: " + ", ".join(sorted(os.listdir(out_dir))))


if __name__ == "__main__":
  define_flags()
  app.run(main)
