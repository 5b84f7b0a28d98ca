"""Losses of Sabour et al. 2017, per example; the caller takes the batch mean."""
import tensorflow as tf


def margin_loss(lengths, labels, m_plus=0.9, m_minus=0.1, down_weight=0.5):
  """Margin loss (Eq. 4) `[batch]`, summed over classes: `L_k = T_k max(0, m+ -
  |v_k|)^2 + lambda (1 - T_k) max(0, |v_k| - m-)^2`. `labels` are `[batch]`
  class ids, or `[batch, k]` for k classes present in each image (MultiMNIST),
  each with T_k = 1."""
  t = tf.one_hot(labels, lengths.shape[-1], dtype=lengths.dtype)
  if t.shape.rank == 3:   # several labels an image
    t = tf.reduce_max(t, axis=1)
  present = tf.square(tf.nn.relu(m_plus - lengths))
  absent = tf.square(tf.nn.relu(lengths - m_minus))
  return tf.reduce_sum(t * present + down_weight * (1.0 - t) * absent, axis=-1)


def reconstruction_loss(reconstructions, images, weight=0.0005):
  """`weight` times the sum of squared pixel errors (Section 4.1) `[batch]` of
  `reconstructions` `[batch, pixels]` against `images` in [0, 1]."""
  target = tf.reshape(images, tf.shape(reconstructions))
  return weight * tf.reduce_sum(tf.square(reconstructions - target), axis=-1)
