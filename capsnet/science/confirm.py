"""The confirmatory protocol (docs/confirm.md): its registration as constants,
the power computation behind its sixteen blocks, the registered rule and the
report from the run files. `python -m capsnet.confirm`."""
import itertools
import json
import os

import numpy as np

from capsnet.running import files
from capsnet.running import runs
from capsnet.science import blocks
from capsnet.science import descriptive
from capsnet.science import grids
from capsnet.science import protocols
from capsnet.science import report as study_report
from capsnet.science import stats

CONFIRM = protocols.CONFIRM   # the registration (docs/confirm.md)
SEEDS, PRECISION = CONFIRM.seeds, CONFIRM.precision
EPOCH, MEASURE = CONFIRM.rule["epoch"], CONFIRM.rule["measure"]   # what the rule judges
PRIMARY, SECONDARY = CONFIRM.primary, CONFIRM.secondary
ALPHA, POWER = CONFIRM.rule["alpha"], CONFIRM.rule["power"]
MARGIN, MARGIN_DESCRIPTIVE = CONFIRM.rule["margin"], CONFIRM.rule["margin_descriptive"]
PILOT_SEEDS = protocols.ALONG.seeds

PARTWAY_FILE = "partway.jsonl"     # published: one row each time a run stops part-way

PILOT = os.path.join(grids.ROOT, "study", protocols.ALONG.name)


# The sequence of the 48 runs (docs/confirm.md): each block's three runs in
# one of the six orders of the variants.

def orders():
  """The six orders of the three variants."""
  return list(itertools.permutations(CONFIRM.variants))


def order_table():
  """{seed: order}: four of the six orders (drawn) used three times, the other
  two twice, shuffled over the sixteen blocks; numpy's default_rng(the rule's order_seed)."""
  rng = np.random.default_rng(CONFIRM.rule["order_seed"])
  thrice = set(rng.permutation(6)[:4].tolist())
  pool = [k for k in range(6) for _ in range(3 if k in thrice else 2)]
  assigned = rng.permutation(pool).tolist()
  return {seed: orders()[k] for seed, k in zip(SEEDS, assigned, strict=True)}


def sequence():
  """The 48 runs in their registered order: [(seed, variant)]."""
  return [(seed, variant) for seed, order in order_table().items() for variant in order]


def table_lines():
  """The order table as the page prints it."""
  lines = ["| block (seed) | first | second | third |", "|---|---|---|---|"]
  lines += [f"| {seed} | " + " | ".join(f"`{v}`" for v in order) + " |"
            for seed, order in order_table().items()]
  return lines


def folder_name(run):
  """The folder of a run of the sequence, (seed, variant)."""
  seed, variant = run
  return study_report.run_name(variant, seed)


def partway_rows(publish):
  """The committed part-way states, oldest first. Raises RunError on a
  damaged file."""
  return runs.read_jsonl(os.path.join(publish, PARTWAY_FILE))


def ended(folder):
  """The run's recorded outcome ("completed" or "failed: ..."), or None."""
  return (runs.RunFolder(folder).read_json(runs.HOST_FILE) or {}).get("outcome")


def progress(publish):
  """(the runs of the sequence ended and published, in order; the next due,
  or None once all have ended)."""
  done = []
  for seed, variant in sequence():
    if ended(os.path.join(publish, folder_name((seed, variant)))) is None:
      return done, (seed, variant)
    done.append((seed, variant))
  return done, None


def power_lines(pilot_found, protocol):
  """The registered power computation as lines of text: the pilot's sd of the
  primary difference, its 95% interval (four degrees of freedom), and the power
  of n blocks."""
  d = _difference(pilot_found, PRIMARY, protocol)
  if d is None or d["sd"] is None:
    raise ValueError("the pilot has fewer than two complete blocks")
  sd, effect, target = d["sd"], POWER["effect"], POWER["target"]
  n = next(k for k in range(3, 1000) if stats.paired_t_power(effect, sd, k, ALPHA) >= target)
  lo, hi = stats.sd_interval(sd, d["n"] - 1)
  fixed = len(SEEDS)
  lines = [
      f"pilot: {d['n']} blocks, {PRIMARY[2]}, {MEASURE} at epoch {EPOCH}: differences "
      f"{', '.join(f'{x:+.2f}' for x in d['diffs'])} points, mean {d['mean']:+.3f}, "
      f"sd {sd:.4f}",
      f"the smallest n with power >= {target:.2f} to call {effect:.2f} points "
      f"(two-sided {ALPHA}): {n} (power {stats.paired_t_power(effect, sd, n, ALPHA):.3f}; "
      f"n - 1: {stats.paired_t_power(effect, sd, n - 1, ALPHA):.3f})",
      f"registered n = {fixed}: power {stats.paired_t_power(effect, sd, fixed, ALPHA):.3f} "
      f"for {effect:.2f} points, {stats.paired_t_power(0.05, sd, fixed, ALPHA):.3f} for "
      f"0.05, {stats.paired_t_power(0.10, sd, fixed, ALPHA):.3f} for 0.10, "
      f"{stats.paired_t_power(abs(d['mean']), sd, fixed, ALPHA):.3f} for the pilot's "
      f"{abs(d['mean']):.3f}",
      f"the sd's 95% interval ({d['n'] - 1} degrees of freedom): [{lo:.4f}, {hi:.4f}]; "
      f"power of n = {fixed} for {effect:.2f} points at its ends: "
      f"{stats.paired_t_power(effect, lo, fixed, ALPHA):.3f} and "
      f"{stats.paired_t_power(effect, hi, fixed, ALPHA):.3f}",
      f"the pilot's power for its own {abs(d['mean']):.3f}: "
      f"{stats.paired_t_power(abs(d['mean']), sd, d['n'], ALPHA):.3f}; for 0.05: "
      f"{stats.paired_t_power(0.05, sd, d['n'], ALPHA):.3f}"]
  return lines


def _difference(found, pair, protocol, level=0.95):
  if EPOCH not in protocol.kept:
    return None
  return stats.paired_difference(*(blocks.figures(found, v, EPOCH, MEASURE) for v in pair[:2]),
                                 level)


def decide(found, protocol, final):
  """The registered calls: {"primary", "equivalence", "secondary", "claim"}.
  Interim (`final` False): the figures without a call."""
  primary = _difference(found, PRIMARY, protocol)
  within = _difference(found, PRIMARY[:2], protocol, level=0.90)
  second = [_difference(found, (a, b), protocol) for a, b, _ in SECONDARY]
  p_values = [stats.t_p_value(d) for d in second]
  rejected, adjusted = stats.holm(p_values, ALPHA)
  signs = [(d["mean"] > 0) - (d["mean"] < 0) if r else 0
           for d, r in zip(second, rejected, strict=True)]
  out = {"final": final,
         "primary": dict(primary or {}, p=stats.t_p_value(primary)),
         "equivalence": dict(within or {}, margin=MARGIN),
         "secondary": [dict(d or {}, p=p, p_holm=q, called=r and final, sign=s)
                       for d, p, q, r, s in zip(second, p_values, adjusted, rejected, signs,
                                                strict=True)]}
  out["primary"]["called"] = bool(primary and primary["called"] and final)
  for key, margin in (("within", MARGIN), ("within_descriptive", MARGIN_DESCRIPTIVE)):
    out["equivalence"][key] = bool(final and within and within["lo"] is not None
                                   and -margin < within["lo"] and within["hi"] < margin)
  # The seed's claim: with the stop r = 3 beats r = 1, without it r = 1 beats r = 3.
  if not final:
    claim = "interim: no verdict"
  elif signs == [-1, +1]:
    claim = "supported"
  elif signs[0] == +1 or signs[1] == -1:
    claim = "contradicted"
  else:
    claim = "not settled"
  out["claim"] = claim
  return out


def host_kind(host):
  """A host.json's machine as the report groups blocks: the CPU's name and
  family and model (older runs: its widest vector instructions)."""
  facts = (host or {}).get("started", {})
  extra = facts.get("cpu_id") or ("AVX-512" if "avx512f" in facts.get("flags", [])
                                    else "AVX2")
  return f"{facts.get('cpu', 'unknown CPU')}, {extra}"


def block_facts(folder, seed):
  """{host, kind, commit, precision, plan} of one block, from its runs' files
  (a field the three runs do not share is listed with " / " between)."""
  seen = {}
  for variant in CONFIRM.variants:
    run = runs.RunFolder(study_report.run_dir(folder, variant, seed))
    host, config = run.read_json(runs.HOST_FILE) or {}, run.config() or {}
    started = host.get("started", {})
    for key, value in (("host", started.get("cpu")), ("kind", host_kind(host)),
                       ("commit", (started.get("commit") or "?")[:12]),
                       ("precision", config.get("model", {}).get("precision")),
                       ("plan", config.get("model", {}).get("conv_plan"))):
      seen.setdefault(key, [])
      if value not in seen[key]:
        seen[key].append(value)
  return {k: " / ".join(str(v) for v in vs) for k, vs in seen.items()}


def _verdict_lines(decision):
  p, e = decision["primary"], decision["equivalence"]
  lines = [f"- **Primary** ({PRIMARY[2]}, {MEASURE} at epoch {EPOCH}, n = {p['n']}): "
           f"{p['mean']:+.3f} points, 95% interval [{p['lo']:+.3f}, {p['hi']:+.3f}], "
           f"p = {p['p']:.3f}: " + ("**called**: " + ("the stop gives the lower test error"
                                                     if p["mean"] > 0 else
                                                     "turning the stop off gives the lower "
                                                     "test error") if p["called"]
                                   else "not called")]
  lines.append(f"- **Equivalence** (90% interval [{e['lo']:+.3f}, {e['hi']:+.3f}] against "
               f"+-{MARGIN:.2f}): " + (f"the stop is **within {MARGIN:.2f} points**"
                                      if e["within"] else
                                      f"not shown within {MARGIN:.2f} points")
               + f"; descriptive, at +-{MARGIN_DESCRIPTIVE:.2f}: " + (
                   "within" if e["within_descriptive"] else "not shown within"))
  for (_, _, name), d in zip(SECONDARY, decision["secondary"], strict=True):
    lines.append(f"- Secondary, {name}: {d['mean']:+.3f} points [{d['lo']:+.3f}, "
                 f"{d['hi']:+.3f}], p = {d['p']:.3f}, Holm-adjusted {d['p_holm']:.3f}: "
                 + ("**called**" if d["called"] else "not called"))
  lines.append(f"- **The claim** (with the stop r = 3 beats r = 1, without it r = 1 beats "
               f"r = 3): **{decision['claim']}**")
  return lines


REGISTERED_HEADING = "## The registered answer"


def registered_answer(text):
  """The lines of a final results.md's registered answer: its heading up to
  the next section's ([] where there is none)."""
  lines = text.splitlines()
  if REGISTERED_HEADING not in lines:
    return []
  start = lines.index(REGISTERED_HEADING)
  end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith("## ")),
             len(lines))
  return lines[start:end]


def markdown(found, protocol, decision, facts, pooled, pilot_blocks, by_kind, partial=(),
             added=()):
  """results.md; `facts`: {seed: block_facts} of the complete blocks; `added`:
  the lines of the figures added after the registration."""
  n = len(facts)
  lines = [f"# {CONFIRM.title}: {n} blocks, as registered", "",
           f"Blocks (seeds): {', '.join(map(str, facts)) or 'none yet'}."
           + blocks.partial_note(partial),
           "Cells: the paired difference B - A over the blocks, its mean and 95% t "
           "interval; B - A > 0: A has the lower loss or error.", "",
           REGISTERED_HEADING, ""] + _verdict_lines(decision) + [""]
  table, _ = blocks.compare(found, protocol)
  lines += ["## Descriptive: every measure and epoch", "",
            "Not part of the rule: **bold** marks an interval that excludes zero, "
            "uncorrected.", ""] + blocks.measure_tables(table, protocol, heading="###",
                                                     pilot_primary=False)
  lines += [f"## Descriptive: pooled with the pilot ({len(pilot_blocks)} + {n} blocks)", "",
            "The pilot's result (docs/along.md) chose this design, so the pooled "
            f"figures are not a test. {MEASURE} at epoch {EPOCH}:", ""]
  lines += study_report.table(["pair (A:B)", "pooled"],
                              [[f"{name} ({a}:{b})", stats.cell(d, "+.3f", "–", True)]
                               for (a, b, name), d in pooled])
  lines += ["", f"## Descriptive: {PRIMARY[2]} by host kind ({MEASURE} at epoch {EPOCH})",
            ""]
  lines += study_report.table(["host kind", "blocks", "difference"],
                              [[kind, ", ".join(map(str, seeds)), stats.cell(d, "+.3f", "–",
                                                                              True)]
                               for kind, seeds, d in by_kind])
  lines += ["", *added, "## The blocks", ""]
  lines += study_report.table(
      ["seed", "host", "host kind", "commit", "precision", "plan"],
      [[seed, f["host"], f["kind"], f["commit"], f["precision"], f["plan"]]
       for seed, f in facts.items()])
  return "\n".join(lines) + "\n"


def plot(found, protocol, decision, path):
  """confirm.png: left, each block's epoch-10 test-error difference for the
  three comparisons with means and 95% intervals (the primary's 90% against the
  equivalence margins), called ones marked; right, the stop's difference along
  training."""
  with study_report.drawing(path, (11, 4.4), ncols=2,
                            gridspec_kw={"width_ratios": [3, 2]}) as (left, right):
    _panels(found, protocol, decision, left, right)


def _panels(found, protocol, decision, left, right):
  pairs = [PRIMARY] + list(SECONDARY)
  called = [decision["primary"]["called"]] + [d["called"] for d in decision["secondary"]]
  for x, ((a, b, _), is_called) in enumerate(zip(pairs, called, strict=True)):
    d = _difference(found, (a, b), protocol)
    if d is None:
      continue
    left.scatter([x - 0.15] * len(d["diffs"]), d["diffs"], s=14, color="grey",
                 alpha=0.7, label="one block" if x == 0 else None)
    if d["lo"] is not None:
      left.errorbar([x + 0.1], [d["mean"]], yerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]],
                    fmt="o", color="C3" if is_called else "C0", capsize=4,
                    label="mean, 95% interval" if x == 0 else None)
  e = decision["equivalence"]
  if e.get("lo") is not None:
    left.errorbar([0.25], [e["mean"]], yerr=[[e["mean"] - e["lo"]], [e["hi"] - e["mean"]]],
                  fmt="s", color="C2", capsize=4, label="primary: 90% interval")
  for y in (-MARGIN, MARGIN):
    left.axhline(y, color="C2", linestyle="--", linewidth=0.8)
  left.axhline(0, color="black", linewidth=0.8)
  left.set_xticks(range(len(pairs)))
  left.set_xticklabels([name.replace(": ", ":\n") + ("\n(called)" if c else "")
                        for (_, _, name), c in zip(pairs, called, strict=True)], fontsize=8)
  left.set_ylabel(f"difference in test error at epoch {EPOCH}, points")
  left.set_title(f"B - A per block ({len(SEEDS)} blocks)\nred: called by the registered rule; "
                 f"dashed: the equivalence margins +-{MARGIN:.2f}", fontsize=9)
  if left.get_legend_handles_labels()[0]:
    left.legend(fontsize=7)
  left.set_xlim(-0.6, len(pairs) - 0.4)
  table, _ = blocks.compare(found, protocol)
  if blocks.epoch_band(right, table[PRIMARY[:2]][MEASURE], protocol.kept, color="C0",
                      band_label="95% interval (descriptive)")[1]:
    right.legend(fontsize=7)
  blocks.epoch_axis(right, protocol.kept)
  right.set_ylabel("test error, nostop - stop, points")
  right.set_title("the stop along training", fontsize=9)


def report(out, protocol, pilot, folder):
  """results.md, results.json and confirm.png into `folder` from the runs in
  `out` and the pilot's in `pilot`; returns the markdown."""
  collected = blocks.collect(out, SEEDS, protocol)   # each run's files read once
  done, found = blocks.complete_blocks(collected, protocol)
  partial = sorted({s for per in collected.values() for s in per} - set(done))
  final = len(done) == len(SEEDS)
  if not final:   # progress only: no difference, no interval
    return progress_report(out, done, folder)
  decision = decide(found, protocol, final)
  pilot_done, pilot_found = blocks.complete_blocks(blocks.collect(pilot, PILOT_SEEDS, protocol),
                                                  protocol)
  pooled_found = {v: {**pilot_found.get(v, {}), **found.get(v, {})} for v in protocol.variants}
  pooled = [((a, b, name), _difference(pooled_found, (a, b), protocol))
            for a, b, name in [PRIMARY, *SECONDARY]]
  facts = {seed: block_facts(out, seed) for seed in done}
  kinds = {}
  for seed, fact in facts.items():
    kinds.setdefault(fact["kind"], []).append(seed)
  by_kind = [(kind, seeds, _difference(blocks.only_seeds(found, seeds), PRIMARY[:2], protocol))
             for kind, seeds in sorted(kinds.items())]
  pilot_sd = (_difference(pilot_found, PRIMARY, protocol) or {}).get("sd")
  added = descriptive.figures(
      descriptive.read_blocks(out, done, protocol.variants, EPOCH), PRIMARY, pilot_sd,
      POWER["effect"], ALPHA,
      descriptive.resumes_and_restarts(out, [folder_name(r) for r in sequence()]))
  text = markdown(found, protocol, decision, facts, pooled, pilot_done, by_kind, partial,
                  descriptive.markdown_lines(added, PRIMARY[2], EPOCH))
  payload = {"title": CONFIRM.title, "final": final, "blocks": done, "incomplete_blocks": partial,
             "registered_seeds": list(SEEDS), "kept_epochs": list(protocol.kept),
             "decision": decision, "pilot_blocks": pilot_done,
             "pooled": [{"a": a, "b": b, **(d or {})} for (a, b, _), d in pooled],
             "by_host_kind": [{"kind": k, "blocks": s, **(d or {})} for k, s, d in by_kind],
             "block_facts": {str(s): f for s, f in facts.items()}, "descriptive": added}
  blocks.write_report(folder, text, payload, found)
  plot(found, protocol, decision, os.path.join(folder, "confirm.png"))
  return text


def killed(attempt):
  """Whether an attempt that another followed was killed: it recorded no end
  (nor, then, a part-way state)."""
  return "end" not in attempt


def attempts_of(folder):
  """[(kind, reason or "")] of a run's attempts in its host.json, lost ones
  first (as "lost"); a killed attempt says so."""
  record = runs.RunFolder(folder).read_json(runs.HOST_FILE) or {}
  attempts = record.get("attempts", [])
  return ([("lost", a.get("lost") or a.get("reason") or "") for a in record.get("lost", [])]
          + [(a.get("kind", "?"), a.get("reason") or (
              "killed: no end recorded" if a is not attempts[-1] and killed(a) else ""))
             for a in attempts])


def progress_report(out, complete, folder):
  """The interim report: the runs done of 48, the blocks complete, each run's
  host and attempts (resumes, restarts) and the part-way states; no figure of
  the question. Writes results.md and results.json (and removes a confirm.png)
  into `folder`; returns the markdown."""
  done, due = progress(out)
  stops = partway_rows(out)
  rows, payload_runs = [], []
  for position, (seed, variant) in enumerate(sequence(), 1):
    name = folder_name((seed, variant))
    path = os.path.join(out, name)
    own = [r for r in stops if r.get("run") == name]
    if (seed, variant) in done:
      state = ended(path)
      record = runs.RunFolder(path).read_json(runs.HOST_FILE) or {}
      kinds = attempts_of(path)
    elif (seed, variant) == due and own:
      # not published yet: its newest stop says where it stands and on what host
      step = own[-1].get("step")
      state = f"part-way (step {'unknown' if step is None else step})"
      record = {"started": own[-1].get("identity") or {}}
      kinds = [("stop", r.get("why", "")) for r in own]
    else:
      continue
    rows.append([position, name, state, host_kind(record),
                 ", ".join(k + (f" ({why})" if why else "") for k, why in kinds)])
    payload_runs.append({"position": position, "run": name, "state": state,
                         "host": host_kind(record), "attempts": [list(k) for k in kinds]})
  n_done = len(done)
  lines = [f"# {CONFIRM.title}: interim, {n_done} of {len(sequence())} runs, {len(complete)} of "
           f"{len(SEEDS)} blocks complete", "",
           "Progress only: no difference and no interval is shown until all "
           f"{study_report.in_words(len(SEEDS))} blocks are in (docs/confirm.md).", "",
           f"Next due: {folder_name(due) if due else 'none'}. Part-way stops recorded: "
           f"{len(stops)}.", ""]
  lines += study_report.table(["#", "run", "state", "host", "attempts"], rows)
  text = "\n".join(lines) + "\n"
  os.makedirs(folder, exist_ok=True)
  files.atomic_write(os.path.join(folder, "results.md"), text)
  files.atomic_write(os.path.join(folder, "results.json"), json.dumps(
      {"title": CONFIRM.title, "final": False, "runs_done": n_done, "runs": payload_runs,
       "blocks_complete": complete, "partway_stops": len(stops),
       "next_due": folder_name(due) if due else None}, indent=1, sort_keys=True) + "\n")
  if os.path.exists(os.path.join(folder, "confirm.png")):
    os.remove(os.path.join(folder, "confirm.png"))
  return text
