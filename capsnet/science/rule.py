"""A registered protocol's rule and report, read from its declaration
(`protocols.Protocol`: its primary and secondary pairs and its rule's
figures): the power computation behind its blocks, the registered calls and
the final report from the run files; while blocks are missing, the progress
report alone (`registered.progress_report`). The confirmatory test
(docs/confirm.md) is one such declaration."""
import os

from capsnet.running import runs
from capsnet.science import blocks
from capsnet.science import descriptive
from capsnet.science import grids
from capsnet.science import protocols
from capsnet.science import registered
from capsnet.science import report as study_report
from capsnet.science import stats

REGISTERED_HEADING = "## The registered answer"


def pilot_of(protocol):
  """(the pilot's declaration, its published folder), or (None, None)."""
  if not protocol.pilot:
    return None, None
  return (protocols.PROTOCOLS[protocol.pilot],
          os.path.join(grids.ROOT, "study", protocol.pilot))


def difference(found, pair, protocol, level=0.95):
  """The paired difference B - A of the rule's measure at its epoch (None
  where the epoch is not kept)."""
  epoch, measure = protocol.rule["epoch"], protocol.rule["measure"]
  if epoch not in protocol.kept:
    return None
  return stats.paired_difference(*(found.by_seed(v, epoch, measure) for v in pair[:2]),
                                 level)


def power_lines(pilot_found, protocol):
  """The registered power computation as lines of text: the pilot's sd of the
  primary difference, its 95% interval, and the power of n blocks."""
  rule, name = protocol.rule, protocol.primary[2]
  d = difference(pilot_found, protocol.primary, protocol)
  if d is None or d["sd"] is None:
    raise ValueError("the pilot has fewer than two complete blocks")
  alpha, sd = rule["alpha"], d["sd"]
  effect, target = rule["power"]["effect"], rule["power"]["target"]
  def power(delta, spread, n):
    return f"{stats.paired_t_power(delta, spread, n, alpha):.3f}"
  n = next(k for k in range(3, 1000) if stats.paired_t_power(effect, sd, k, alpha) >= target)
  lo, hi = stats.sd_interval(sd, d["n"] - 1)
  fixed, own = len(protocol.seeds), abs(d["mean"])
  return [
      f"pilot: {d['n']} blocks, {name}, {rule['measure']} at epoch {rule['epoch']}: "
      f"differences {', '.join(f'{x:+.2f}' for x in d['diffs'])} points, mean "
      f"{d['mean']:+.3f}, sd {sd:.4f}",
      f"the smallest n with power >= {target:.2f} to call {effect:.2f} points "
      f"(two-sided {alpha}): {n} (power {power(effect, sd, n)}; n - 1: "
      f"{power(effect, sd, n - 1)})",
      f"registered n = {fixed}: power {power(effect, sd, fixed)} for {effect:.2f} points, "
      f"{power(0.05, sd, fixed)} for 0.05, {power(0.10, sd, fixed)} for 0.10, "
      f"{power(own, sd, fixed)} for the pilot's {own:.3f}",
      f"the sd's 95% interval ({d['n'] - 1} degrees of freedom): [{lo:.4f}, {hi:.4f}]; "
      f"power of n = {fixed} for {effect:.2f} points at its ends: {power(effect, lo, fixed)} "
      f"and {power(effect, hi, fixed)}",
      f"the pilot's power for its own {own:.3f}: {power(own, sd, d['n'])}; for 0.05: "
      f"{power(0.05, sd, d['n'])}"]


def decide(found, protocol, final):
  """The registered calls: {"primary", "equivalence", "secondary", "claim"}.
  Interim (`final` False): the figures without a call."""
  rule = protocol.rule
  primary = difference(found, protocol.primary, protocol)
  within = difference(found, protocol.primary, protocol, level=0.90)
  second = [difference(found, pair, protocol) for pair in protocol.secondary]
  p_values = [stats.t_p_value(d) for d in second]
  rejected, adjusted = stats.holm(p_values, rule["alpha"])
  signs = [(d["mean"] > 0) - (d["mean"] < 0) if r else 0
           for d, r in zip(second, rejected, strict=True)]
  out = {"final": final,
         "primary": dict(primary or {}, p=stats.t_p_value(primary)),
         "equivalence": dict(within or {}, margin=rule["margin"]),
         "secondary": [dict(d or {}, p=p, p_holm=q, called=r and final, sign=s)
                       for d, p, q, r, s in zip(second, p_values, adjusted, rejected, signs,
                                                strict=True)]}
  out["primary"]["called"] = bool(primary and primary["called"] and final)
  for key, margin in (("within", rule["margin"]),
                      ("within_descriptive", rule["margin_descriptive"])):
    out["equivalence"][key] = bool(final and within and within["lo"] is not None
                                   and -margin < within["lo"] and within["hi"] < margin)
  # The claim: the secondary pairs' signs it predicts (+1: B - A > 0), if any.
  expected = list(rule["claim"]["signs"]) if "claim" in rule else None
  if expected is None:
    out["claim"] = None
  elif not final:
    out["claim"] = "interim: no verdict"
  elif signs == expected:
    out["claim"] = "supported"
  elif any(s == -e for s, e in zip(signs, expected, strict=True)):
    out["claim"] = "contradicted"
  else:
    out["claim"] = "not settled"
  return out


def block_facts(folder, seed, protocol):
  """{host, kind, commit, precision, plan} of one block, from its runs' files
  (a field the runs do not share is listed with " / " between)."""
  seen = {}
  for variant in protocol.variants:
    run = runs.RunFolder(study_report.run_dir(folder, variant, seed))
    host, config = run.read_json(runs.HOST_FILE) or {}, run.config() or {}
    started = host.get("started", {})
    for key, value in (("host", started.get("cpu")), ("kind", registered.host_kind(started)),
                       ("commit", (started.get("commit") or "?")[:12]),
                       ("precision", config.get("model", {}).get("precision")),
                       ("plan", config.get("model", {}).get("conv_plan"))):
      seen.setdefault(key, [])
      if value not in seen[key]:
        seen[key].append(value)
  return {k: " / ".join(str(v) for v in vs) for k, vs in seen.items()}


def verdict_lines(decision, protocol):
  """The registered answer's lines, in the rule's own words."""
  rule, says = protocol.rule, protocol.rule["says"]
  margin, p, e = rule["margin"], decision["primary"], decision["equivalence"]
  lines = [f"- **Primary** ({protocol.primary[2]}, {rule['measure']} at epoch "
           f"{rule['epoch']}, n = {p['n']}): {p['mean']:+.3f} points, 95% interval "
           f"[{p['lo']:+.3f}, {p['hi']:+.3f}], p = {p['p']:.3f}: "
           + ("**called**: " + (says["a_lower"] if p["mean"] > 0 else says["b_lower"])
              if p["called"] else "not called")]
  lines.append(f"- **Equivalence** (90% interval [{e['lo']:+.3f}, {e['hi']:+.3f}] against "
               f"+-{margin:.2f}): " + (f"{says['subject']} is **within {margin:.2f} points**"
                                       if e["within"] else
                                       f"not shown within {margin:.2f} points")
               + f"; descriptive, at +-{rule['margin_descriptive']:.2f}: " + (
                   "within" if e["within_descriptive"] else "not shown within"))
  for (_, _, name), d in zip(protocol.secondary, decision["secondary"], strict=True):
    lines.append(f"- Secondary, {name}: {d['mean']:+.3f} points [{d['lo']:+.3f}, "
                 f"{d['hi']:+.3f}], p = {d['p']:.3f}, Holm-adjusted {d['p_holm']:.3f}: "
                 + ("**called**" if d["called"] else "not called"))
  if decision["claim"] is not None:
    lines.append(f"- **The claim** ({rule['claim']['text']}): **{decision['claim']}**")
  return lines


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
  """results.md; `facts`: {seed: block_facts} of the complete blocks; `pooled`:
  with the pilot's blocks (none: no such section); `added`: the lines of the
  figures added after the registration."""
  n, rule = len(facts), protocol.rule
  measure, epoch = rule["measure"], rule["epoch"]
  lines = [f"# {protocol.title}: {n} blocks, as registered", "",
           f"Blocks (seeds): {', '.join(map(str, facts)) or 'none yet'}."
           + blocks.partial_note(partial),
           "Cells: the paired difference B - A over the blocks, its mean and 95% t "
           "interval; B - A > 0: A has the lower loss or error.", "",
           REGISTERED_HEADING, ""] + verdict_lines(decision, protocol) + [""]
  table, _ = blocks.compare(found, protocol)
  lines += ["## Descriptive: every measure and epoch", "",
            "Not part of the rule: **bold** marks an interval that excludes zero, "
            "uncorrected.", ""] + blocks.measure_tables(table, protocol, heading="###",
                                                     pilot_primary=False)
  if pooled:
    lines += [f"## Descriptive: pooled with the pilot ({len(pilot_blocks)} + {n} blocks)",
              "", f"The pilot's result (docs/{protocol.pilot}.md) chose this design, so the "
              f"pooled figures are not a test. {measure} at epoch {epoch}:", ""]
    lines += study_report.table(["pair (A:B)", "pooled"],
                                [[f"{name} ({a}:{b})", stats.cell(d, "+.3f", "–", True)]
                                 for (a, b, name), d in pooled]) + [""]
  lines += [f"## Descriptive: {protocol.primary[2]} by host kind ({measure} at epoch "
            f"{epoch})", ""]
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
  """<name>.png: left, each block's difference at the rule's epoch for the
  primary and secondary pairs with means and 95% intervals (the primary's 90%
  against the equivalence margins), called ones marked; right, the primary's
  difference along training."""
  with study_report.drawing(path, (11, 4.4), ncols=2,
                            gridspec_kw={"width_ratios": [3, 2]}) as (left, right):
    _panels(found, protocol, decision, left, right)


def _panels(found, protocol, decision, left, right):
  rule, margin = protocol.rule, protocol.rule["margin"]
  pairs = [protocol.primary, *protocol.secondary]
  called = [decision["primary"]["called"]] + [d["called"] for d in decision["secondary"]]
  for x, ((a, b, _), is_called) in enumerate(zip(pairs, called, strict=True)):
    d = difference(found, (a, b), protocol)
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
  for y in (-margin, margin):
    left.axhline(y, color="C2", linestyle="--", linewidth=0.8)
  left.axhline(0, color="black", linewidth=0.8)
  left.set_xticks(range(len(pairs)))
  left.set_xticklabels([name.replace(": ", ":\n") + ("\n(called)" if c else "")
                        for (_, _, name), c in zip(pairs, called, strict=True)], fontsize=8)
  left.set_ylabel(f"difference in test error at epoch {rule['epoch']}, points")
  left.set_title(f"B - A per block ({len(protocol.seeds)} blocks)\nred: called by the "
                 f"registered rule; dashed: the equivalence margins +-{margin:.2f}",
                 fontsize=9)
  if left.get_legend_handles_labels()[0]:
    left.legend(fontsize=7)
  left.set_xlim(-0.6, len(pairs) - 0.4)
  table, _ = blocks.compare(found, protocol)
  if blocks.epoch_band(right, table[protocol.primary[:2]][rule["measure"]], protocol.kept,
                       color="C0", band_label="95% interval (descriptive)")[1]:
    right.legend(fontsize=7)
  blocks.epoch_axis(right, protocol.kept)
  subject, _, difference_ = protocol.primary[2].partition(": ")
  right.set_ylabel(f"test error, {difference_}, points")
  right.set_title(f"{subject} along training", fontsize=9)


def report(out, protocol, folder):
  """results.md, results.json and <name>.png into `folder` from the runs in
  `out` (and the pilot's published runs); while blocks are missing, the
  progress report. Returns the markdown."""
  collected = blocks.collect(out, protocol.seeds, protocol)   # each run's files read once
  done, found = collected.complete(protocol)
  partial = sorted(set(collected.seeds) - set(done))
  final = len(done) == len(protocol.seeds)
  if not final:   # progress only: no difference, no interval
    return registered.progress_report(protocol, out, done, folder)
  decision = decide(found, protocol, final)
  rule, primary = protocol.rule, protocol.primary
  pilot, pilot_folder = pilot_of(protocol)
  pilot_done, pilot_found, pooled = [], blocks.Scores(), []
  if pilot:
    pilot_done, pilot_found = blocks.collect(pilot_folder, pilot.seeds, protocol).complete(
        protocol)
    pooled = [((a, b, name), difference(pilot_found | found, (a, b), protocol))
              for a, b, name in [primary, *protocol.secondary]]
  facts = {seed: block_facts(out, seed, protocol) for seed in done}
  kinds = {}
  for seed, fact in facts.items():
    kinds.setdefault(fact["kind"], []).append(seed)
  by_kind = [(kind, seeds, difference(found.of(seeds), primary, protocol))
             for kind, seeds in sorted(kinds.items())]
  added = descriptive.compute(
      descriptive.read_blocks(out, done, protocol.variants, rule["epoch"]), primary,
      (difference(pilot_found, primary, protocol) or {}).get("sd"), rule["power"]["effect"],
      rule["alpha"], descriptive.resumes_and_restarts(
          out, [registered.folder_name(r) for r in registered.sequence(protocol)]))
  text = markdown(found, protocol, decision, facts, pooled, pilot_done, by_kind, partial,
                  descriptive.markdown_lines(added, primary[2], rule["epoch"]))
  details = {"blocks": done, "incomplete_blocks": partial,
             "registered_seeds": list(protocol.seeds), "kept_epochs": list(protocol.kept),
             "decision": decision, "pilot_blocks": pilot_done,
             "pooled": [{"a": a, "b": b, **(d or {})} for (a, b, _), d in pooled],
             "by_host_kind": [{"kind": k, "blocks": s, **(d or {})} for k, s, d in by_kind],
             "block_facts": {str(s): f for s, f in facts.items()}, "descriptive": added}
  blocks.write_report(folder, text, protocol, final, found,
                      blocks.compare(found, protocol)[0], details)
  plot(found, protocol, decision, os.path.join(folder, f"{protocol.name}.png"))
  return text
