"""Each part of a step (training, or the forward alone) against its own limit:
max(its FLOPs / the matmul peak, the bytes it must move at least / the
memory bandwidth), both measured by `capsnet.bench` in the same round; the
parts (`PARTS`) are found by the op names of a step trace (`part_of`).
docs/performance.md says what is counted and the figures of each host.
Importing this module imports no TensorFlow.
"""
import dataclasses
import itertools

PARTS = ("conv1", "primary_caps/transforms", "primary_caps/products", "u_hat",
         "routing", "decoder", "adam", "other")
TITLES = {"conv1": "Conv1", "primary_caps/transforms": "PrimaryCaps: DFT transforms",
          "primary_caps/products": "PrimaryCaps: products, bias, squash (all "
          "of it for a direct method)", "u_hat": "u_hat = W u", "routing": "routing",
          "decoder": "decoder", "adam": "Adam updates", "other": "other"}


def part_of(op_name):
  """The `PARTS` entry an op of the training step belongs to, by its name
  (gradients included: `gradients/capsnet/<layer>/...`)."""
  if "Adam" in op_name:
    return "adam"
  if "primary_caps" in op_name:
    return ("primary_caps/products" if "/products" in op_name or "/dft/" not in op_name
            else "primary_caps/transforms")
  if "conv1" in op_name:
    return "conv1"
  if "digit_caps/routing" in op_name:
    return "routing"
  if "digit_caps" in op_name:
    return "u_hat"
  if "decoder" in op_name:
    return "decoder"
  return "other"


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float    # floating-point operations (a multiply-add is 2)
  bytes: float    # bytes moved at least

  def __add__(self, other):
    return Cost(self.flops + other.flops, self.bytes + other.bytes)

  def limit(self, peak_gflops, bandwidth_gbs):
    """Seconds this work cannot beat: max(FLOPs / peak, bytes / bandwidth)."""
    return max(self.flops / (peak_gflops * 1e9), self.bytes / (bandwidth_gbs * 1e9))


def dft_multiply_adds(batch, h, w, c, k, n, stride, products=3):
  """Forward multiply-adds of `fast_conv._dft_conv`, (transforms, products):
  the input's width and height transforms, the kernel's, the inverse at the
  strided outputs; and the per-bin contraction (Gauss's 3 real products, 4 in
  bfloat16). The height's transform makes the products' operands at once:
  3 real combinations of the DFT under Gauss, its 2 parts in bfloat16, and
  the inverse takes as many blocks."""
  oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
  nh, nw = stride * (oh - 1) + k, stride * (ow - 1) + k
  bw = nw // 2 + 1
  blocks = 3 if products == 3 else 2
  x_width = 2 * h * bw * w * batch * c
  x_height = 2 * blocks * nh * h * bw * batch * c
  kernel = 2 * k * bw * k * c * n + 2 * blocks * nh * k * bw * c * n
  inverse = 2 * oh * blocks * nh * bw * batch * n + 2 * oh * ow * bw * batch * n
  return (x_width + x_height, kernel, inverse), nh * bw * batch * c * n * products


def conv_costs(method, batch, h, w, c, k, n, stride, input_grad, itemsize, bf16,
               train=True):
  """{part: Cost} of one convolution by `method`: its forward and, if `train`,
  its gradients (weights, bias and, with `input_grad`, the input); parts
  "transforms" and "products" (a direct method: all of it "products")."""
  oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
  x, y, wt = batch * h * w * c, batch * oh * ow * n, k * k * c * n
  moved = itemsize * (x + wt + y)   # forward: read x, w, write y
  passes = 1                        # products: the forward's, then the gradients'
  if train:   # read dy, x (and w), write dw (and dx)
    moved += itemsize * (y + x + wt + (wt + x if input_grad else 0))
    passes += 2 if input_grad else 1
  if method != "dft":
    return {"transforms": Cost(0, 0),
            "products": Cost(2 * batch * oh * ow * k * k * c * n * passes, moved)}
  (x_tf, kernel, inverse), products = dft_multiply_adds(batch, h, w, c, k, n, stride,
                                                        4 if bf16 else 3)
  x_passes = 2 if train and input_grad else 1   # the input's transforms, their gradient
  w_passes = 2 if train else 1
  transforms = 2 * (x_tf * x_passes + w_passes * (kernel + inverse))
  return {"transforms": Cost(transforms, 0),
          "products": Cost(2 * products * passes, moved)}


def step_costs(cfg, batch, methods, itemsize=4, train=True):
  """{part: Cost} of one step of `cfg` (a `network.ModelConfig`) at `batch`, the
  convolutions by `methods` ({layer: method}): a training step (forward,
  gradients, Adam), or with `train` False the forward alone."""
  bf16 = cfg.precision == "bf16"
  conv_item = 2 if bf16 else itemsize
  c1 = conv_costs(methods["conv1"], batch, cfg.image_size, cfg.image_size,
                  cfg.image_channels, cfg.conv1_kernel, cfg.conv1_channels, 1, False,
                  conv_item, bf16, train)
  pc = conv_costs(methods["primary_caps"], batch, cfg.conv1_size, cfg.conv1_size,
                  cfg.conv1_channels, cfg.primary_kernel,
                  cfg.primary_types * cfg.primary_dim, cfg.primary_stride, True,
                  conv_item, bf16, train)
  i, o, k, d, r = (cfg.in_caps, cfg.num_classes, cfg.primary_dim, cfg.digit_dim,
                   cfg.iter_routing)
  u, w_caps, u_hat = batch * i * k, i * o * k * d, batch * i * o * d
  dense = 3 if train else 1   # a dense product's passes: forward, both gradients
  costs = {
      "conv1": c1["transforms"] + c1["products"],
      "primary_caps/transforms": pc["transforms"],
      "primary_caps/products": pc["products"],
      # forward: read u, W, write u_hat; the gradients of W and u: read
      # d u_hat, u, W, write dW, du
      "u_hat": Cost(dense * 2 * u_hat * k, itemsize * (
          u + w_caps + u_hat + (u_hat + 2 * u + 2 * w_caps if train else 0))),
  }
  passes = 2 * r - 1                               # r weighted sums, r - 1 agreements
  back = 0 if not train else 1 if cfg.stop_gradient or r == 1 else passes
  costs["routing"] = Cost(2 * u_hat * (passes + back), itemsize * u_hat * (passes + back))
  sizes = [o * d, *cfg.decoder_units, cfg.num_pixels] if cfg.use_decoder else []
  weights = sum(a * b for a, b in itertools.pairwise(sizes))
  costs["decoder"] = Cost(dense * 2 * batch * weights, itemsize * dense * weights)
  params = (cfg.conv1_kernel ** 2 * cfg.image_channels * cfg.conv1_channels
            + cfg.primary_kernel ** 2 * cfg.conv1_channels * cfg.primary_types
            * cfg.primary_dim + w_caps + weights)
  # read p, m, v, g; write p, m, v
  costs["adam"] = Cost(10 * params, 4 * 7 * params) if train else Cost(0, 0)
  costs["other"] = Cost(0, 0)
  return costs


# The convolutions as direct ones: the nominal count by which the benchmark
# states every step's rate, whatever method ran.
DIRECT = {"conv1": "conv2d", "primary_caps": "conv2d"}


def nominal_flops(cfg, batch, train):
  """FLOPs of one step of `cfg` at `batch`, its convolutions counted as direct
  ones (`DIRECT`)."""
  return sum(c.flops for c in step_costs(cfg, batch, DIRECT, train=train).values())


def methods_of(cfg, device=None):
  """{layer: method} the model computes its convolutions with."""
  # Here, not at the top: fast_conv imports TensorFlow, and the benchmark
  # imports this module before its children import TensorFlow (`startup`).
  from capsnet.model import fast_conv  # pylint: disable=import-outside-toplevel
  if cfg.conv_plan:
    return fast_conv.parse_plan(cfg.conv_plan)
  impl = fast_conv.resolve_impl(cfg.conv_impl, device)
  dtype = "bfloat16" if cfg.precision == "bf16" else cfg.dtype
  return {
      "conv1": fast_conv.choose_method(impl, dtype, 1,
                                       cfg.conv1_kernel ** 2 * cfg.image_channels),
      "primary_caps": fast_conv.choose_method(impl, dtype, cfg.primary_stride,
                                              cfg.primary_kernel ** 2
                                              * cfg.conv1_channels)}


def table(costs, times_ms, peak_gflops, bandwidth_gbs):
  """Rows {part, ms, gflop, mb, limit_ms, fraction} for the parts timed,
  and the step's row ("step": the parts' limits summed over their times)."""
  rows = []
  for part in PARTS:
    if part not in times_ms:
      continue
    cost = costs.get(part, Cost(0, 0))
    limit = 1e3 * cost.limit(peak_gflops, bandwidth_gbs)
    rows.append({"part": part, "ms": times_ms[part], "gflop": cost.flops / 1e9,
                 "mb": cost.bytes / 1e6, "limit_ms": limit,
                 "fraction": limit / times_ms[part] if times_ms[part] else None})
  total = sum(r["ms"] for r in rows)
  limit = sum(r["limit_ms"] for r in rows)
  rows.append({"part": "step", "ms": total, "gflop": sum(r["gflop"] for r in rows),
               "mb": sum(r["mb"] for r in rows), "limit_ms": limit,
               "fraction": limit / total if total else None})
  return rows
