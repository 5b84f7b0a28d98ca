"""Ships a run's best checkpoint as weights: model variables only.

  python -m capsnet.pretrained --run=$HOME/table1/r3_recon_seed0 --out=pretrained/r3_recon

Writes <out>/best/model.ckpt-<step> (the `capsnet/` variables in float32, the
averaged weights under their own names where the run chose them) and
<out>/config.json (the run's, precision fp32, plus the weights' origin), so that
`python eval.py --checkpoint <out>` scores them like any run.
"""
import os
import sys

from absl import app
from absl import flags

from capsnet.running import startup


def define_flags():
  """Defined when run as a program only (importing adds no global flags)."""
  flags.DEFINE_string("run", None, "training logdir whose best checkpoint to ship")
  flags.DEFINE_string("out", None, "folder to write (must not exist)")


FLAGS = flags.FLAGS


def ship(run, out):
  """Copies the model variables of `run`'s best checkpoint to `out`; returns the
  new prefix. Raises RunError for a missing, damaged or unusable run, or an
  existing `out`."""
  import numpy as np
  import tensorflow as tf

  from capsnet.running import runs
  ckpt, run_dir = runs.resolve(run, "best")
  reason = runs.damage(ckpt)
  if reason:
    raise runs.RunError(f"{ckpt}: damaged checkpoint ({reason})")
  if os.path.exists(out):
    raise runs.RunError(f"--out={out}: exists; give a new folder")
  reader = tf.train.load_checkpoint(ckpt)
  names = sorted(n for n in reader.get_variable_to_shape_map()
                 if n.startswith("capsnet/") and "Adam" not in n
                 and not n.endswith(runs.AVERAGE_SUFFIX))
  weights = runs.chosen_weights(ckpt)   # the averages, if they won validation
  source = {n: n + (runs.AVERAGE_SUFFIX if weights == "averaged" else "") for n in names}
  prefix = os.path.join(runs.RunFolder(out).checkpoint_folder("best"),
                        f"{runs.CHECKPOINT_PREFIX}-{runs.step_of(ckpt)}")
  os.makedirs(os.path.dirname(prefix))
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    variables = [tf.compat.v1.get_variable(
        n, initializer=reader.get_tensor(source[n]).astype(np.float32)) for n in names]
    sess.run(tf.compat.v1.variables_initializer(variables))
    tf.compat.v1.train.Saver(variables, save_relative_paths=True).save(
        sess, prefix, write_meta_graph=False)
  saved = runs.RunFolder(run_dir).config()
  # float32 weights are evaluated in float32 by default: the same figures on
  # every CPU (bfloat16 rounding differs between CPU kinds).
  shipped_from = {"run": os.path.basename(os.path.normpath(run_dir)),
                  "checkpoint": os.path.relpath(ckpt, run_dir),
                  "step": runs.step_of(ckpt), "weights": weights,
                  "trained_precision": saved["model"]["precision"]}
  runs.RunFolder(out).write_config(dict(saved["model"], precision="fp32"),
                                   saved.get("train", {}), shipped_from=shipped_from)
  return prefix


def main(argv):
  del argv
  startup.import_tensorflow()
  from capsnet.running import runs
  if not FLAGS.run or not FLAGS.out:
    sys.exit("pretrained: error: --run and --out are required")
  try:
    prefix = ship(FLAGS.run, FLAGS.out)
  except runs.RunError as e:
    sys.exit(f"pretrained: error: {e}")
  size = sum(os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(FLAGS.out) for f in fs)
  print(f"wrote {prefix} ({size / 2**20:.1f} MiB in {FLAGS.out})")


if __name__ == "__main__":
  define_flags()
  app.run(main)
