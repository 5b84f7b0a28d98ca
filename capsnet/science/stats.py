"""Paired comparisons of seeds: the mean difference with a t interval, called
only when its 95% interval excludes zero (docs/table1.md)."""
import math
import statistics


def t_two_sided_coverage(t, df):
  """P(|T| <= t) for Student's t with `df` (a positive int) degrees of freedom:
  the closed form of Abramowitz and Stegun 26.7.3 and 26.7.4, theta = atan(t /
  sqrt(df))."""
  if df < 1 or int(df) != df:
    raise ValueError(f"t_two_sided_coverage: df must be a positive int, got {df!r}")
  theta = math.atan(abs(t) / math.sqrt(df))
  cos2 = math.cos(theta) ** 2
  if df % 2:   # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2.4/3.5 cos^4 ...))
    term, series = 1.0, 1.0 if df > 1 else 0.0
    for k in range(1, (df - 1) // 2):
      term *= cos2 * (2 * k) / (2 * k + 1)
      series += term
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
  term, series = 1.0, 1.0   # even: sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 ...)
  for k in range(1, df // 2):
    term *= cos2 * (2 * k - 1) / (2 * k)
    series += term
  return math.sin(theta) * series


def t_quantile(p, df):
  """The t with P(T <= t) = p (0.5 < p < 1), `df` degrees of freedom; e.g.
  t_quantile(0.975, 2) = 4.303. Found by bisection on the closed form."""
  if not 0.5 < p < 1:
    raise ValueError(f"t_quantile: p must be in (0.5, 1), got {p!r}")
  return _inverse(lambda t: t_two_sided_coverage(t, df), 2 * p - 1)


def _inverse(increasing, target):
  """The x >= 0 with increasing(x) = target, by doubling then bisection."""
  lo, hi = 0.0, 1.0
  while increasing(hi) < target:
    hi *= 2
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if increasing(mid) < target else (lo, mid)
  return (lo + hi) / 2


def paired_difference(a, b, level=0.95):
  """Per-seed differences b - a (`a`, `b`: seed -> figure or None) and their
  mean with a `level` t interval: a dict of seeds, diffs, n, mean, sd, t, lo, hi
  (sd, lo and hi None for n < 2) and called (the interval excludes zero); None
  if no seed pairs."""
  seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
  if not seeds:
    return None
  diffs = [b[s] - a[s] for s in seeds]
  n, mean = len(diffs), statistics.mean(diffs)
  result = {"seeds": seeds, "diffs": diffs, "n": n, "mean": mean, "sd": None,
            "t": None, "lo": None, "hi": None, "called": False}
  if n > 1:
    sd = statistics.stdev(diffs)
    t = t_quantile(0.5 + level / 2, n - 1)
    half = t * sd / math.sqrt(n)
    result.update(sd=sd, t=t, lo=mean - half, hi=mean + half,
                  called=mean - half > 0 or mean + half < 0)
  return result


def cell(d, spec, missing="", show_n=False):
  """A table's cell for a `paired_difference` result: the mean and its
  interval, **bold** where called; `missing` for None; `show_n`: the pair
  count after the interval too."""
  if d is None:
    return missing
  n = f"n = {d['n']}"
  if d["lo"] is None:
    return f"{format(d['mean'], spec)} ({n})"
  text = (f"{format(d['mean'], spec)} [{format(d['lo'], spec)}, "
          f"{format(d['hi'], spec)}]" + (f", {n}" if show_n else ""))
  return f"**{text}**" if d["called"] else text


def verdict(d, unit="points", spec="+.3f", within=False):
  """The decision rule's sentence for a `paired_difference` result, figures
  formatted by `spec`; `within`: a null reads "within [lo, hi]"."""
  if d is None:
    return "no paired seeds"
  if d["lo"] is None:
    return f"one seed pair ({format(d['mean'], spec)} {unit}): no interval"
  interval = f"[{format(d['lo'], spec)}, {format(d['hi'], spec)}]"
  if d["called"]:
    return f"called: {format(d['mean'], spec)} {unit}, 95% interval {interval}"
  if within:
    return f"within {interval}"
  return f"not measurable at this budget: the interval is {interval}"


def t_p_value(d):
  """The two-sided p of the paired t test of a `paired_difference` result
  (None for fewer than two pairs; 0 when the differences are all equal and
  not zero, 1 when they are all zero)."""
  if d is None or d["n"] < 2:
    return None
  if d["sd"] == 0:
    return 1.0 if d["mean"] == 0 else 0.0
  t = d["mean"] / (d["sd"] / math.sqrt(d["n"]))
  return 1 - t_two_sided_coverage(t, d["n"] - 1)


def holm(p_values, alpha=0.05):
  """Holm's step-down rule over `p_values` (a list; None: not testable, never
  rejected): which hypotheses are rejected at family-wise level `alpha`, and
  the Holm-adjusted p values, each in the order given."""
  order = sorted((p, k) for k, p in enumerate(p_values) if p is not None)
  m = len(order)
  rejected, adjusted = [False] * len(p_values), [None] * len(p_values)
  running, stopped = 0.0, False
  for rank, (p, k) in enumerate(order):
    running = max(running, min(1.0, (m - rank) * p))
    adjusted[k] = running
    stopped = stopped or p > alpha / (m - rank)
    rejected[k] = not stopped
  return rejected, adjusted


def _normal_cdf(x):
  return 0.5 * math.erfc(-x / math.sqrt(2))


def paired_t_power(delta, sd, n, alpha=0.05, points=20000):
  """The power of the two-sided paired t test at level `alpha` with `n` pairs
  whose differences have mean `delta` and sd `sd`.

  T = (Z + nc) / S is noncentral t, nc = delta sqrt(n) / sd, S = sqrt(V / (n -
  1)), V chi-squared with n - 1 degrees of freedom; E_S[P(Z > t S - nc) + P(Z <
  -t S - nc)] is integrated over S's density by the midpoint rule.
  """
  if n < 2 or sd <= 0:
    raise ValueError(f"paired_t_power: needs n >= 2 and sd > 0, got n={n!r}, sd={sd!r}")
  df = n - 1
  t = t_quantile(1 - alpha / 2, df)
  nc = delta * math.sqrt(n) / sd
  top = math.sqrt((df + 12 * math.sqrt(2 * df) + 40) / df)   # S beyond it: no mass
  width = top / points
  log_norm = math.log(2 * df) - (df / 2) * math.log(2) - math.lgamma(df / 2)
  power = 0.0
  for k in range(points):
    s = (k + 0.5) * width
    # density of S: 2 df s f_chi2(df s^2)
    log_f = log_norm + math.log(s) + (df / 2 - 1) * math.log(df * s * s) - df * s * s / 2
    power += math.exp(log_f) * (1 - _normal_cdf(t * s - nc) + _normal_cdf(-t * s - nc))
  return power * width


def chi2_cdf(x, df):
  """P(V <= x) for V chi-squared with `df` degrees of freedom (the
  regularised lower incomplete gamma function, by its series)."""
  if x <= 0:
    return 0.0
  a, z = df / 2, x / 2
  term = total = 1 / a
  k = 0
  while term > total * 1e-16:
    k += 1
    term *= z / (a + k)
    total += term
  return math.exp(a * math.log(z) - z - math.lgamma(a)) * total


def sd_interval(sd, df, level=0.95):
  """The `level` confidence interval of a normal standard deviation whose
  estimate `sd` has `df` degrees of freedom: sd sqrt(df / chi2 quantiles)."""
  def quantile(p):
    return _inverse(lambda x: chi2_cdf(x, df), p)
  tail = (1 - level) / 2
  return sd * math.sqrt(df / quantile(1 - tail)), sd * math.sqrt(df / quantile(tail))
