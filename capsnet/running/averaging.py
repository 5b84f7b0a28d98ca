"""Weight averaging (train.py --ema_decay)."""
import tensorflow as tf

from capsnet.running import evaluation


def weight_averaging(cfg, ema_decay, eval_batch_size, state, train_op, device, task):
  """(The train op with an exponential moving average's update after it, an
  `EvalGraph` on the averaged weights).

  `num_updates` is the global step, so the decay is min(--ema_decay, (1 + step)
  / (10 + step)); the shadow variables are in every checkpoint, and the raw
  weights' updates are the same ops as without them.
  """
  ema = tf.compat.v1.train.ExponentialMovingAverage(ema_decay,
                                                    num_updates=state.global_step)
  model_vars = [v for v in tf.compat.v1.trainable_variables()
                if v.op.name.startswith("capsnet/")]
  with tf.control_dependencies([train_op]):
    train_op = ema.apply(model_vars)
  state.add_averaging()

  def averaged(getter, *args, **kwargs):
    return ema.average(getter(*args, **kwargs))
  with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                   custom_getter=averaged), \
      tf.name_scope("averaged"):
    ev = evaluation.build(cfg, eval_batch_size, device, task)
  return train_op, ev
