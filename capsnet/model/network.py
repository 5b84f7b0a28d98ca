"""CapsNet graph builder: config, forward pass, towers and gradient averaging.

Knows nothing about paths, sessions or flags: `forward` takes tensors and a
`ModelConfig`, so tests build small graphs directly.
"""
import collections
import dataclasses

import tensorflow as tf

from capsnet.model import fast_conv
from capsnet.model import layers
from capsnet.model import losses
from capsnet.model import routing

# ModelConfig.capsule_layers: the paper's layers, or those of the authors'
# code (Sarasra/models, research/capsules), which differ from the text:
# - PrimaryCaps: a one-iteration capsule layer over its 32 types, so the
#   convolution's output is divided by 32 before its bias (0.1 at first) and
#   the squash;
# - DigitCaps: a learned bias [10, 16] (0.1 at first) added to s_j before the
#   squash in every routing iteration (160 more parameters: 8,215,728);
# - initialisers: truncated normal, stddev 0.05 for Conv1 and 0.1 for
#   PrimaryCaps, W and the decoder, every bias 0.1 (paper: Glorot uniform and
#   zero biases, W from N(0, 0.01)).
# Routing, the margin loss and the decoder's shape are the same; the loss
# balance is recon_weight's (the official code's is 0.01 against the summed
# margin loss, see docs/table1.md), the stop_gradient switch its own.
CAPSULE_LAYERS = ("paper", "official")


def _field(default, description):
  """A ModelConfig field: its default and what it is (the flag's help)."""
  return dataclasses.field(default=default, metadata={"help": description})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """CapsNet hyperparameters; defaults are the paper's MNIST model. Each
  field's description is its command-line flag's help (config.py)."""
  image_size: int = _field(28, "input height = width in pixels")
  image_channels: int = _field(1, "input channels")
  num_classes: int = _field(10, "number of classes = DigitCaps")
  conv1_channels: int = _field(256, "Conv1 filters (9x9, stride 1, ReLU)")
  conv1_kernel: int = _field(9, "Conv1 kernel size")
  primary_types: int = _field(32, "PrimaryCaps capsule types")
  primary_dim: int = _field(8, "PrimaryCaps capsule dimension")
  primary_kernel: int = _field(9, "PrimaryCaps kernel size")
  primary_stride: int = _field(2, "PrimaryCaps stride")
  digit_dim: int = _field(16, "DigitCaps capsule dimension")
  iter_routing: int = _field(3, "routing iterations r (Procedure 1)")
  stop_gradient: bool = _field(True, "inner routing iterations read stop_gradient(u_hat)")
  capsule_layers: str = _field(
      "paper", "paper: the layers and initialisers of the paper's text; official: "
      "those of the authors' code (PrimaryCaps divided by its 32 types plus a bias, "
      "a bias on DigitCaps' s_j, truncated-normal weights, biases 0.1; see README)")
  m_plus: float = _field(0.9, "margin loss m+")
  m_minus: float = _field(0.1, "margin loss m-")
  down_weight: float = _field(0.5, "margin loss lambda (weight of absent classes)")
  decoder_units: tuple = _field((512, 1024), "decoder hidden layer sizes (its output "
                                "is the image)")
  use_decoder: bool = _field(True, "train with the reconstruction decoder")
  recon_weight: float = _field(0.0005, "weight of the summed squared reconstruction "
                               "error")
  dtype: str = _field("float32", "variable and routing dtype: float32 or float64")
  precision: str = _field(
      "fp32", "fp32, or bf16: convolutions and decoder matmuls in bfloat16 (mixed; "
      "variables, u_hat, routing and losses in float32; fast on a CPU with AMX)")
  conv_impl: str = _field(
      "auto", "how the convolutions are computed: auto (train.py: each "
      "convolution's fastest method measured on this host and cached, conv_plan; "
      "TensorFlow's on a GPU; without a plan custom_grad on the CPU), custom_grad "
      "(strided gradients as stride-1 convolutions, in bf16 also the strided "
      "forward over 4 images side by side; Conv1's filter gradient as one GEMM), "
      "conv2d (TensorFlow's conv2d and gradients; cuDNN on a GPU) or dft (strided "
      "convolutions by an exact discrete Fourier transform)")
  conv_plan: str = _field(
      "", "each convolution's method, conv1:M,primary_caps:M (M: conv2d, patch_gemm, "
      "dilated, folded, dft); empty: conv_impl decides (train.py records the "
      "measured plan in config.json)")

  def __post_init__(self):
    object.__setattr__(self, "decoder_units", tuple(self.decoder_units))
    for name in ("image_size", "image_channels", "num_classes",
                 "conv1_channels", "conv1_kernel", "primary_types",
                 "primary_dim", "primary_kernel", "primary_stride",
                 "digit_dim", "iter_routing"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, "
                         f"got {value!r}")
    for name in ("stop_gradient", "use_decoder"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"ModelConfig.{name} must be True or False, "
                         f"got {getattr(self, name)!r}")
    if not all(isinstance(u, int) and u > 0 for u in self.decoder_units):
      raise ValueError("ModelConfig.decoder_units must be positive ints, "
                       f"got {self.decoder_units!r}")
    if not 0.0 < self.m_plus <= 1.0:
      raise ValueError(f"ModelConfig.m_plus must be in (0, 1], got {self.m_plus!r}")
    if not 0.0 <= self.m_minus < self.m_plus:
      raise ValueError("ModelConfig.m_minus must be in [0, m_plus), "
                       f"got {self.m_minus!r}")
    for name in ("down_weight", "recon_weight"):
      if not getattr(self, name) >= 0.0:
        raise ValueError(f"ModelConfig.{name} must be >= 0, "
                         f"got {getattr(self, name)!r}")
    choices = {"dtype": ("float32", "float64"), "precision": ("fp32", "bf16"),
               "conv_impl": fast_conv.IMPLS, "capsule_layers": CAPSULE_LAYERS}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"ModelConfig.{name} must be one of {allowed}, "
                         f"got {getattr(self, name)!r}")
    fast_conv.parse_plan(self.conv_plan)   # raises ValueError naming the plan
    if self.precision == "bf16" and self.dtype != "float32":
      raise ValueError("ModelConfig.precision='bf16' needs dtype='float32', "
                       f"got dtype={self.dtype!r}")
    if self.primary_size < 1:
      raise ValueError(
          f"ModelConfig.image_size={self.image_size} is too small for "
          f"conv1_kernel={self.conv1_kernel} and primary_kernel="
          f"{self.primary_kernel}: PrimaryCaps would have no positions")

  @property
  def conv1_size(self):
    return self.image_size - self.conv1_kernel + 1

  @property
  def primary_size(self):
    return (self.conv1_size - self.primary_kernel) // self.primary_stride + 1

  @property
  def in_caps(self):
    """Number of primary capsules (1152 for the paper's MNIST model)."""
    return self.primary_size ** 2 * self.primary_types

  @property
  def num_pixels(self):
    return self.image_size ** 2 * self.image_channels


Outputs = collections.namedtuple("Outputs", [
    "u",                # [batch, in_caps, primary_dim] primary capsules
    "u_hat",            # [batch, in_caps, num_classes, digit_dim] predictions
    "couplings",        # iter_routing x [batch, in_caps, num_classes], first first
    "v",                # [batch, num_classes, digit_dim] DigitCaps
    "lengths",          # [batch, num_classes] capsule lengths
    "predictions",      # [batch] int32 argmax of lengths ([batch, 2]: the two
                        #   longest, for two digits an image)
    "reconstructions",  # [batch, num_pixels] decoder output ([batch, 2,
                        #   num_pixels] for two digits), or None
    "margin_loss",      # [batch]
    "recon_loss",       # [batch] (zeros without decoder)
    "loss",             # scalar: batch mean of margin + reconstruction
    "accuracy",         # scalar
])


def forward(images, labels, cfg, training, device=None, targets=None, heads="one_digit"):
  """Builds CapsNet on `images` in variable scope `capsnet` (AUTO_REUSE: another
  tower or an eval graph reuses the variables); returns `Outputs`.

  Args:
    images: `[batch, image_size, image_size, image_channels]` in [0, 1].
    labels: `[batch]` class ids, or `[batch, 2]` with the two-digit heads.
    training: the decoder sees the capsule of the true label, else of the
      predicted class.
    device: the device the model is placed on, for `conv_impl="auto"`.
    targets: the two-digit heads' reconstruction targets `[batch, 2, h, w, c]`.
    heads: the name of the task's `HEADS`: losses, decoder and prediction.
  Raises: ValueError if images, labels or targets do not fit the config and heads.
  """
  if heads not in HEADS:
    raise ValueError(f"forward: heads={heads!r}: expected one of {sorted(HEADS)}")
  head = HEADS[heads]
  if labels.shape.rank != head.label_rank:
    raise ValueError(f"forward: labels must be [batch{', 2' if head.label_rank == 2 else ''}] "
                     f"with heads={heads!r}, got shape {labels.shape}")
  if head.targets and cfg.use_decoder and targets is None:
    raise ValueError("forward: two labels an image need the two targets")
  expected = [cfg.image_size, cfg.image_size, cfg.image_channels]
  if images.shape.rank != 4 or images.shape[1:].as_list() != expected:
    raise ValueError(f"forward: images must be [batch, {expected[0]}, "
                     f"{expected[1]}, {expected[2]}], got shape {images.shape}")
  precision = precision_policy(cfg)
  conv_impl = fast_conv.resolve_impl(cfg.conv_impl, device)
  plan = fast_conv.parse_plan(cfg.conv_plan)
  official = cfg.capsule_layers == "official"
  images = tf.cast(images, precision.variables)
  labels = tf.cast(labels, tf.int32)
  with tf.compat.v1.variable_scope("capsnet", reuse=tf.compat.v1.AUTO_REUSE):
    x = layers.conv1(images, cfg.conv1_channels, cfg.conv1_kernel, precision,
                     conv_impl, official, plan.get("conv1"))
    u = layers.primary_caps(x, cfg.primary_types, cfg.primary_dim,
                            cfg.primary_kernel, cfg.primary_stride, precision,
                            conv_impl, official, plan.get("primary_caps"))  # [b, i, k]
    v, couplings, u_hat = layers.digit_caps(u, cfg.num_classes, cfg.digit_dim,
                                            cfg.iter_routing, cfg.stop_gradient, official)
    lengths = routing.safe_norm(v)                   # [b, o]
    recon_targets = images
    if head.targets:
      recon_targets = tf.cast(targets, precision.variables) if cfg.use_decoder else None
    predictions, recon, margin, recon_loss, accuracy = head.build(
        v, lengths, labels, recon_targets, cfg, training)
    loss = tf.reduce_mean(margin + recon_loss, name="loss")
    accuracy = tf.reduce_mean(accuracy, name="accuracy")
  return Outputs(u, u_hat, list(couplings), v, lengths, predictions, recon,
                 margin, recon_loss, loss, accuracy)


def _one_digit_heads(v, lengths, labels, images, cfg, training):
  """The paper's heads (Section 3, 4.1): margin loss, the decoder on the label's
  capsule (the predicted one outside training), the longest capsule as the
  prediction. Returns (predictions `[b]`, reconstructions or None, margin loss,
  reconstruction loss, correct)."""
  predictions = tf.argmax(lengths, axis=1, output_type=tf.int32)
  margin = losses.margin_loss(lengths, labels, cfg.m_plus, cfg.m_minus, cfg.down_weight)
  recon, recon_loss = None, tf.zeros_like(margin)
  if cfg.use_decoder:
    recon = _masked_decoder(v, labels if training else predictions, cfg)
    recon_loss = losses.reconstruction_loss(recon, images, cfg.recon_weight)
  return predictions, recon, margin, recon_loss, tf.cast(tf.equal(predictions, labels),
                                                         v.dtype)


def _two_digit_heads(v, lengths, labels, targets, cfg, training):
  """MultiMNIST heads (Section 6): margin loss with both labels present, each
  digit reconstructed from its own capsule, the two longest capsules as the
  prediction (correct if they are the two labels). Returns (predictions `[b,
  2]`, reconstructions `[b, 2, pixels]` or None, margin loss, reconstruction
  loss, correct)."""
  top2 = tf.math.top_k(lengths, 2).indices                     # [b, 2]
  margin = losses.margin_loss(lengths, labels, cfg.m_plus, cfg.m_minus,
                              cfg.down_weight)
  recon, recon_loss = None, tf.zeros_like(margin)
  if targets is not None:
    classes = labels if training else top2
    recon = tf.stack([_masked_decoder(v, classes[:, d], cfg) for d in range(2)], 1)
    def term(d, t):
      return losses.reconstruction_loss(recon[:, d], targets[:, t], cfg.recon_weight)
    recon_loss = term(0, 0) + term(1, 1)
    if not training:   # the predicted pair in either order against the labels
      recon_loss = tf.minimum(recon_loss, term(0, 1) + term(1, 0))
  hits = tf.reduce_sum(tf.cast(tf.reduce_any(
      tf.equal(top2[:, :, None], labels[:, None, :]), axis=2), tf.int32), axis=1)
  return top2, recon, margin, recon_loss, tf.cast(tf.equal(hits, 2), v.dtype)


# The heads a task picks by name (`tasks`' `heads`): what builds them, the
# rank of the labels, and whether the decoder needs the targets (each digit
# alone) instead of the image.
Heads = collections.namedtuple("Heads", ["build", "label_rank", "targets"])
HEADS = {"one_digit": Heads(_one_digit_heads, 1, False),
         "two_digits": Heads(_two_digit_heads, 2, True)}


def decode(v, classes, cfg):
  """The decoder's image `[batch, num_pixels]` of capsule `classes[n]` of
  `v[n]`, the others masked, on `forward`'s variables; with `v` fed freely it
  draws perturbed capsules (Figure 4). Raises ValueError without a decoder."""
  if not cfg.use_decoder:
    raise ValueError("decode: the config has use_decoder=False")
  with tf.compat.v1.variable_scope("capsnet", reuse=tf.compat.v1.AUTO_REUSE):
    return _masked_decoder(v, tf.cast(classes, tf.int32), cfg)


def _masked_decoder(v, classes, cfg):
  mask = tf.one_hot(classes, cfg.num_classes, dtype=v.dtype)   # [b, o]
  masked = tf.reshape(v * mask[..., None], [-1, cfg.num_classes * cfg.digit_dim])
  return layers.decoder(masked, cfg.decoder_units, cfg.num_pixels,
                        precision_policy(cfg), cfg.capsule_layers == "official")


def precision_policy(cfg):
  """The one place that decides the dtypes (a `layers.Precision`): the
  variables, capsules, `u_hat`, routing and losses in `cfg.dtype`; the
  convolutions and the decoder's matmuls in bfloat16 with
  `precision="bf16"`, else in `cfg.dtype` too."""
  variables = tf.as_dtype(cfg.dtype)
  return layers.Precision(variables,
                          tf.bfloat16 if cfg.precision == "bf16" else variables)


def _placement(variable_device, compute_device):
  """Device function: variables on `variable_device` (a device or a device
  function, e.g. `replica_device_setter`), other ops on `compute_device`."""
  var_ops = {"Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable"}

  def place(op):
    if op.device:
      return op.device
    if op.type not in var_ops:
      return compute_device
    return variable_device(op) if callable(variable_device) else variable_device
  return place


def tower_gradients(images, labels, cfg, optimizer, devices, variable_device=None,
                    targets=None, heads="one_digit"):
  """Splits the batch over `devices` (one tower each, name scopes `tower_{i}`
  over one `capsnet` variable scope) and returns (grads_and_vars averaged over
  the towers, the towers' `Outputs`). The variables live on `variable_device` if
  given (a device or device function), else on the one device, or on the CPU
  with several towers."""
  if not devices:
    raise ValueError("tower_gradients: need at least one device")
  n = len(devices)
  image_parts = tf.split(images, n) if n > 1 else [images]
  label_parts = tf.split(labels, n) if n > 1 else [labels]
  target_parts = [None] * n if targets is None else (
      tf.split(targets, n) if n > 1 else [targets])
  all_grads, outputs = [], []
  for i, device in enumerate(devices):
    variables_at = variable_device or (device if n == 1 else "/cpu:0")
    with tf.compat.v1.device(_placement(variables_at, device)), \
        tf.name_scope(f"tower_{i}"):
      out = forward(image_parts[i], label_parts[i], cfg, training=True,
                    device=device, targets=target_parts[i], heads=heads)
      all_grads.append(optimizer.compute_gradients(
          out.loss, colocate_gradients_with_ops=True))
      outputs.append(out)
  if n == 1:
    return all_grads[0], outputs
  with tf.device("/cpu:0"):
    return average_gradients(all_grads), outputs


def tower_mean(tensors):
  """The mean of one tensor a tower, added in tower order
  (`routing.ordered_sum`: the same bits in every run)."""
  return routing.ordered_sum(tensors) / float(len(tensors))


def average_gradients(tower_grads):
  """One list of (mean gradient, variable) pairs from one list a tower (the
  variables in the same order)."""
  averaged = []
  for pairs in zip(*tower_grads, strict=True):
    grads = [g for g, _ in pairs if g is not None]
    mean = tower_mean(grads) if grads else None
    averaged.append((mean, pairs[0][1]))
  return averaged


def routing_movement(c):
  """How far routing moved the couplings `c [batch, in_caps, out_caps]` from
  uniform, per example: (the mean entropy of c_i over out_caps, in nats:
  log(out_caps) when uniform; the mean of max_j c_ij), each `[batch]`."""
  entropy = -tf.reduce_sum(tf.math.xlogy(c, c), axis=2)   # [b, i]; 0 log 0 = 0
  return tf.reduce_mean(entropy, axis=1), tf.reduce_mean(tf.reduce_max(c, axis=2), axis=1)


DIAG_VARS = ("digit_caps/weights", "primary_caps/weights", "conv1/weights")


def gradient_diagnostic(images, labels, cfg, device=None, targets=None,
                        heads="one_digit"):
  """How much of the gradient flows through the routing coefficients: {variable:
  `||g_full - g_stop|| / ||g_full||`} (0 for r = 1), the model built twice on
  the same variables and batch."""
  grads = {}
  for stop in (True, False):
    mode = dataclasses.replace(cfg, stop_gradient=stop)
    with tf.name_scope(f"diag_stop_{stop}"):
      out = forward(images, labels, mode, training=True, device=device,
                    targets=targets, heads=heads)
    variables = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
    wrt = [variables["capsnet/" + n] for n in DIAG_VARS]
    grads[stop] = tf.gradients(out.loss, wrt)
  return {name: tf.norm(full - stop) / tf.norm(full)
          for name, stop, full in zip(DIAG_VARS, grads[True], grads[False], strict=True)}


def training_summaries(out, images, lr):
  """TensorBoard summaries of a training step (tower 0): loss terms, accuracy,
  learning rate, routing entropy and max c per iteration, inputs beside their
  reconstructions."""
  scalar = tf.compat.v1.summary.scalar
  items = [scalar("loss/total", out.loss),
           scalar("loss/margin", tf.reduce_mean(out.margin_loss)),
           scalar("loss/reconstruction", tf.reduce_mean(out.recon_loss)),
           scalar("accuracy", out.accuracy),
           scalar("learning_rate", lr)]
  for r, c in enumerate(out.couplings):
    entropy, max_c = routing_movement(c)
    items.append(scalar(f"routing/entropy_iter_{r}", tf.reduce_mean(entropy)))
    items.append(scalar(f"routing/max_c_iter_{r}", tf.reduce_mean(max_c)))
  if out.reconstructions is not None:
    first = out.reconstructions[:4]
    if first.shape.rank == 3:   # two digits: the first label's
      first = first[:, 0]
    recon = tf.reshape(first, tf.shape(images[:4]))
    pairs = tf.concat([tf.cast(images[:4], recon.dtype), recon], axis=2)
    items.append(tf.compat.v1.summary.image("input_vs_reconstruction", pairs,
                                            max_outputs=4))
  return tf.compat.v1.summary.merge(items)
