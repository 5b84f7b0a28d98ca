"""The answer across protocols (`study/answer.md`): each protocol's paired
differences by length of training, side by side, from their results.json alone,
the confirmatory test's row first once all its blocks are in.
`python -m capsnet.answer`."""
import json
import os

from capsnet.running import files
from capsnet.running import runs
from capsnet.science import protocols
from capsnet.science import report
from capsnet.science import stats

MEASURES = (("test_margin_loss", "mean test margin loss (the protocols' primary "
             "measure)", "+.5f"),
            ("test_error", "test error, % points", "+.3f"))

ROUTED = tuple(v for v, flags in protocols.STOP_VARIANTS.items()   # couplings that move
               if flags["iter_routing"] > 1)

ANSWERED = ("confirm", "short", "along", "table1")   # study/<name>/results.json


DIFFERENCE = ("seeds", "diffs", "n", "mean", "sd", "t", "lo", "hi", "called")


def _read(study, protocol):
  """<study>/<protocol>/results.json.
  Raises: runs.RunError naming the file if it is missing or not JSON."""
  folder = runs.RunFolder(os.path.join(study, protocol))
  results = folder.read_json("results.json")
  if results is None:
    raise runs.RunError(f"{folder.file('results.json')}: missing (the {protocol} "
                        "protocol's results; --protocols names the ones to put side "
                        "by side)")
  return results


def _finished(results, decay_steps):
  """{variant: {seed: run}} of a grid report's finished runs at one schedule."""
  out = {}
  for x in results["runs"]:
    if x["complete"] and x["decay_steps"] == decay_steps:
      out.setdefault(x["variant"], {})[x["seed"]] = x
  return out


def _grid_row(label, selection, runs_by_variant):
  """A seeded grid's row: each pair's paired differences, the routed variants'
  mean largest coupling after the last iteration and their last gradient share."""
  row = {"length": label, "selection": selection, "pairs": {}, "mechanism": {}}
  for a, b, _ in protocols.STOP_PAIRS:
    row["pairs"][f"{a}:{b}"] = {
        key: stats.paired_difference(
            *({s: x[key] for s, x in runs_by_variant.get(v, {}).items()} for v in (a, b)))
        for key, _, _ in MEASURES}
  for v in ROUTED:
    done = list(runs_by_variant.get(v, {}).values())
    row["mechanism"][v] = _mechanism(
        [(x.get("routing") or {}).get("own", {}).get("max_c", [None])[-1] for x in done],
        [x["diag"]["digit_caps/weights"][1] for x in done])
  return row


def _block_row(results, epoch, label):
  """A block report's row at `epoch`: each pair's paired differences (its
  comparisons), the routed variants' mean largest coupling and gradient share."""
  row = {"length": label, "selection": "none", "pairs": {}, "mechanism": {}}
  for c in results["comparisons"]:
    if c["epoch"] == epoch:
      row["pairs"].setdefault(f"{c['a']}:{c['b']}", {})[c["measure"]] = {
          k: c[k] for k in DIFFERENCE}
  for v in ROUTED:
    per = [x["epochs"][str(epoch)] for x in results["runs"]
           if x["variant"] == v and str(epoch) in x["epochs"]]
    row["mechanism"][v] = _mechanism([m.get("max_c") for m in per],
                                     [m.get("grad_share") for m in per])
  return row


def _mechanism(max_c, grad_share):
  """The mean largest coupling and gradient share of a variant's runs, and n."""
  return {"max_c": report.mean_or_none(max_c), "grad_share": report.mean_or_none(grad_share),
          "n": len(max_c)}


def _confirm_row(results):
  """The confirmatory test's row (docs/confirm.md): its registered figures at
  the rule's epoch, each test-error cell called only where the registered rule
  calls it (Holm for the secondary pair); the margin loss, not registered, is
  never called."""
  protocol, decision = protocols.CONFIRM, results["details"]["decision"]
  epoch, measure = protocol.rule["epoch"], protocol.rule["measure"]
  row = _block_row(results, epoch, f"epoch {epoch}, paper's schedule: confirmatory, "
                                   f"{len(results['details']['blocks'])} blocks")
  for (a, b, _), d in zip([protocol.primary, *protocol.secondary],
                          [decision["primary"], *decision["secondary"]], strict=True):
    margin = row["pairs"][f"{a}:{b}"]["test_margin_loss"]
    row["pairs"][f"{a}:{b}"] = {measure: {k: d[k] for k in DIFFERENCE},
                                "test_margin_loss": dict(margin, called=False)}
  return row


def rows(study, names=ANSWERED):
  """The rows from <study>/<name>/results.json of the protocols `names`. Raises
  RunError naming a missing or damaged file, ValueError for none or an unknown
  protocol."""
  unknown = [p for p in names if p not in ANSWERED]
  if unknown or not names:
    raise ValueError(f"--protocols={','.join(names)}: expected one or more of "
                     f"{','.join(ANSWERED)}")
  out = []
  confirm = _read(study, "confirm") if "confirm" in names else None
  if confirm and confirm["final"]:   # interim: progress only, no figure
    out.append(_confirm_row(confirm))
  short = _read(study, "short") if "short" in names else None
  if short:
    out.append(_grid_row("5 epochs, compressed schedule", "best validation",
                         _finished(short, protocols.SHORT.decay_steps)))
  along = _read(study, "along") if "along" in names else None
  if along:
    out += [_block_row(along, epoch, f"epoch {epoch}, paper's schedule")
            for epoch in along["details"]["kept_epochs"]]
  table1 = _read(study, "table1") if "table1" in names else None
  if table1:
    out.append(_grid_row("50 epochs, paper's schedule", "best validation",
                         _finished(table1, protocols.TABLE1.decay_steps)))
  return out


def markdown(table):
  lines = ["# The stop_gradient question along training", "",
           "From study/confirm, study/short, study/along and study/table1's "
           "results.json (`python -m capsnet.answer`). Cells: the paired difference "
           "B - A over the blocks or seeds with both runs, its mean and 95% t "
           "interval; **bold** = called (the interval excludes zero); B - A > 0: A has "
           "the lower loss or error. n = 1: one pair, no interval, nothing called. "
           "The confirmatory row (docs/confirm.md), once its blocks are all in: "
           "called only by its registered rule (the test error; Holm-corrected for the "
           "two routing pairs), its margin loss never.", ""]
  for key, what, spec in MEASURES:
    lines += [f"## {what}", ""] + report.table(
        ["training", "checkpoint chosen on",
         *(f"{name} ({a}:{b})" for a, b, name in protocols.STOP_PAIRS)],
        [[row["length"], row["selection"], *(
            stats.cell(row["pairs"].get(f"{a}:{b}", {}).get(key), spec, "–", show_n=True)
            for a, b, _ in protocols.STOP_PAIRS)]
         for row in table]) + [""]
  lines += ["## How far routing moves the couplings (descriptive)", "",
            "Mean largest coupling after the last of three iterations on the test "
            "images (uniform: 0.1), and the share of W's gradient that flows "
            "through the couplings (||g_full - g_stop|| / ||g_full||, the last "
            "gradient diagnostic), mean over the runs (n).", ""]
  def figure(m, key, spec):
    return "–" if m.get(key) is None else f"{format(m[key], spec)} (n = {m['n']})"
  lines += report.table(
      ["training", *(f"{v}: {what}" for v in ROUTED
                     for what in ("largest coupling", "gradient share"))],
      [[row["length"], *(figure(row["mechanism"].get(v, {}), key, spec) for v in ROUTED
                         for key, spec in (("max_c", ".4f"), ("grad_share", ".3f")))]
       for row in table])
  return "\n".join(lines) + "\n"


def write(study, out=None, names=ANSWERED):
  """answer.md and answer.json into `out` (default `study`), nothing if a
  protocol's results are missing or damaged; returns the markdown."""
  out = out or study
  table = rows(study, names)
  text = markdown(table)
  os.makedirs(out, exist_ok=True)
  files.atomic_write(os.path.join(out, "answer.md"), text)
  files.atomic_write(os.path.join(out, "answer.json"),
                     json.dumps(table, indent=1, sort_keys=True) + "\n")
  return text
