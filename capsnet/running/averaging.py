"""Weight averaging (train.py --ema_decay): an exponential moving average of
the model variables, updated after each step, and an evaluation graph that
reads the averages."""
import tensorflow as tf

from capsnet.running import evaluation


def weight_averaging(cfg, ema_decay, eval_batch_size, state, train_op, device, task):
  """An exponential moving average of the model variables, updated after
  each step, and an evaluation graph that reads the averages.

  `tf.train.ExponentialMovingAverage` with `num_updates` = the global step,
  so the decay is min(--ema_decay, (1 + step) / (10 + step)): the early
  averages follow the weights. The shadow variables
  (`<variable>/ExponentialMovingAverage`) are in every checkpoint; the raw
  weights' updates are the same ops as without them.

  Returns: (the train op with the average's update after it, an `EvalGraph`
    on the averaged weights).
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
