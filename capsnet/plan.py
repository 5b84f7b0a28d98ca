"""Plans this host's convolutions (capsnet/running/planner.py): times each
convolution's methods on the paper model's real shapes, prints the plan and
caches it where train.py finds it.

  python -m capsnet.plan --precision=bf16   # plan, print, cache
  python -m capsnet.plan --inference        # the forward alone, as eval.py plans
"""
import time

from absl import app
from absl import flags

from capsnet.running import planner  # imports TensorFlow as train.py does (oneDNN on)

FLAGS = flags.FLAGS


def define_flags():
  """The program's flags."""
  flags.DEFINE_enum("precision", "fp32", ["fp32", "bf16"], "the model's precision")
  flags.DEFINE_integer("batch_size", 128, "the batch one tower computes", lower_bound=1)
  flags.DEFINE_bool("inference", False, "plan the forward alone (eval.py "
                    "--conv_impl=auto), not the training step")


def main(argv):
  from capsnet.model import network  # pylint: disable=import-outside-toplevel
  del argv
  start = time.perf_counter()
  cfg = network.ModelConfig(precision=FLAGS.precision)
  plan, report = planner.plan_convolutions(cfg, FLAGS.batch_size, not FLAGS.inference)
  print(f"{plan}  ({planner.describe(report)}; {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
