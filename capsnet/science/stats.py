"""Paired comparisons of seeds: the mean difference with a t interval, called
only when its 95% interval excludes zero (docs/table1.md). Student's t, the
noncentral t and the chi-squared distribution are scipy.stats'."""
import math
import statistics

from scipy import stats as distributions


def t_quantile(p, df):
  """The t with P(T <= t) = p (0.5 < p < 1), `df` degrees of freedom; e.g.
  t_quantile(0.975, 2) = 4.303."""
  if not 0.5 < p < 1:
    raise ValueError(f"t_quantile: p must be in (0.5, 1), got {p!r}")
  return float(distributions.t.ppf(p, df))


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
  return float(2 * distributions.t.sf(abs(t), d["n"] - 1))


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


def paired_t_power(delta, sd, n, alpha=0.05):
  """The power of the two-sided paired t test at level `alpha` with `n` pairs
  whose differences have mean `delta` and sd `sd`: P(|T| > t) for T noncentral
  t with n - 1 degrees of freedom and noncentrality delta sqrt(n) / sd."""
  if n < 2 or sd <= 0:
    raise ValueError(f"paired_t_power: needs n >= 2 and sd > 0, got n={n!r}, sd={sd!r}")
  df, nc = n - 1, delta * math.sqrt(n) / sd
  t = t_quantile(1 - alpha / 2, df)
  return float(distributions.nct.sf(t, df, nc) + distributions.nct.cdf(-t, df, nc))


def sd_interval(sd, df, level=0.95):
  """The `level` confidence interval of a normal standard deviation whose
  estimate `sd` has `df` degrees of freedom: sd sqrt(df / chi2 quantiles)."""
  tail = (1 - level) / 2
  return tuple(float(sd * math.sqrt(df / distributions.chi2.ppf(q, df)))
               for q in (1 - tail, tail))
