"""The along-training protocol (docs/along.md, `protocols.ALONG`): its rule
(paired differences, calls, reversals) and report from the run files, on the
block machinery of `blocks`. `python -m capsnet.along` is its command line.
"""
import os

from capsnet.science import blocks
from capsnet.science import report as study_report


def markdown(found, table, reversals, protocol, done, partial=()):
  """results.md; `partial`: the seeds of incomplete blocks, left out."""
  n_int = sum(1 for pairs in table.values() for per in pairs.values()
              for d in per.values() if d["lo"] is not None)
  n_called = sum(1 for pairs in table.values() for per in pairs.values()
                 for d in per.values() if d["called"])
  final = done >= len(protocol.seeds)
  lines = [f"# {protocol.title}", "",
           f"{done} block(s) (seeds {', '.join(map(str, found.seeds))})"
           + ("" if final else ": **interim**, the rule judges "
              f"{study_report.in_words(len(protocol.seeds))} blocks") + "."
           + blocks.partial_note(partial),
           "Cells: the paired difference B - A over the blocks, its mean and 95% t "
           "interval; **bold** = called (the interval excludes zero). B - A > 0: A "
           "has the lower loss or error.", ""]
  lines += blocks.measure_tables(table, protocol)
  lines += ["## Calls", "",
            f"{n_called} of {n_int} intervals exclude zero; with no difference "
            f"anywhere about {0.05 * n_int:.1f} would by chance (95% each, not "
            "corrected for multiplicity)."]
  if reversals:
    lines += ["", "The ordering reverses with training (called at an earlier "
              "registered epoch on one side, at a later one on the other):"]
    lines += [f"- {a}:{b}, {key}: epoch {e1} against epoch {e2}"
              for a, b, key, e1, e2 in reversals]
  else:
    lines += ["", "No reversal is called."]
  lines += ["", "## Per variant (mean over blocks; descriptive)", "",
            "The couplings from the test scoring; the gradient share from the "
            "epoch's last gradient diagnostic (||g_full - g_stop|| / ||g_full|| of "
            "W, on a fixed batch of 32).", ""]
  columns = (("test_margin_loss", ".5f", "test margin loss"),
             ("test_error", ".3f", "test error %"),
             *((("affine_error", ".3f", "affine error %"),)
               if "affine" in protocol.test_sets else ()),
             ("train_loss", ".5f", "train loss"), ("val_loss", ".5f", "val loss"),
             ("max_c", ".4f", "mean largest coupling, last iteration"),
             ("grad_share", ".3f", "share of W's gradient through the couplings"))
  def row(variant, epoch):
    ms = found.at(variant, epoch).values()
    means = [[m[k] for m in ms if m.get(k) is not None] for k, _, _ in columns]
    return [variant, epoch, *(format(sum(v) / len(v), spec) if v else ""
                              for v, (_, spec, _) in zip(means, columns, strict=True))]
  lines += study_report.table(
      ["variant", "epoch", *(what for _, _, what in columns)],
      [row(v, e) for v in protocol.variants for e in protocol.kept if found.at(v, e)])
  return "\n".join(lines) + "\n"


def plot(table, protocol, path):
  """along.png: each pair's paired difference against epoch with its 95%
  interval band, one panel per measure."""
  n, kept = len(protocol.measures), protocol.kept
  with study_report.drawing(path, (4.2 * n, 3.8), ncols=n) as axes:
    for ax, (key, what, _) in zip(axes, protocol.measures, strict=True):
      drawn = [blocks.epoch_band(ax, table[(a, b)][key], kept, label=name)[0]
               for a, b, name in protocol.pairs]
      blocks.epoch_axis(ax, kept, fixed=not any(drawn))   # no complete block: the epochs
      ax.set_title(f"B - A: {what}", fontsize=9)
    axes[0].legend(fontsize=7)


def report(found, protocol, folder):
  """results.md, results.json and along.png into `folder`. Returns the markdown."""
  done, complete = found.complete(protocol)
  partial = sorted(set(found.seeds) - set(done))
  found = complete
  table, reversals = blocks.compare(found, protocol)
  text = markdown(found, table, reversals, protocol, len(done), partial)
  details = {"blocks": done, "incomplete_blocks": partial, "kept_epochs": list(protocol.kept),
             "reversals": [dict(zip(("a", "b", "measure", "earlier", "later"), r, strict=True))
                           for r in reversals]}
  blocks.write_report(folder, text, protocol, len(done) >= len(protocol.seeds), found, table,
                      details)
  plot(table, protocol, os.path.join(folder, "along.png"))
  return text


