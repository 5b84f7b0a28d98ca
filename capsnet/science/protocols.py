"""Each study protocol as one declaration (`Protocol`): everything its
registration fixes (variants, seeds, epochs and schedule, kept epochs,
measures, the pairs it compares, its primary and secondary, precision) and
how its report shows it. Programs, reports, the answer across protocols and
the docs' tests read them here; nothing restates them. Adding one:
docs/studies.md."""
import dataclasses

from capsnet.data import tasks
from capsnet.running import schedule

EMA_DECAY = 0.999   # weight averaging: a time constant of 1,000 steps, 2.3 epochs

_RECON = dict(stop_gradient=True, use_decoder=True)

# The stop_gradient question's three variants, the same flags in every
# protocol that asks it, and its three pairs (A, B, what B - A is).
STOP_VARIANTS = {
    "r1_recon": dict(iter_routing=1, **_RECON),
    "r3_recon": dict(iter_routing=3, **_RECON),
    "r3_recon_nostop": dict(iter_routing=3, stop_gradient=False, use_decoder=True)}
STOP_PAIRS = (("r3_recon", "r3_recon_nostop", "the stop: nostop - stop"),
              ("r1_recon", "r3_recon", "routing with the stop: r3 - r1"),
              ("r1_recon", "r3_recon_nostop", "routing without it: r3 nostop - r1"))

LAST_EPOCHS = 10   # the late validation figure: the mean of the last 10 epochs

# Measures: (a run's key, what it is, its format).
BEST_VALIDATION = (
    ("test_error", "test error of the best-validation checkpoint, %", "+.3f"),
    ("last_val_error", f"mean validation error of the last {LAST_EPOCHS} epochs, %", "+.3f"))
SHORT_MEASURES = (("test_error", "test error, %", "+.3f"),
                  ("test_margin_loss", "mean test margin loss per example", "+.5f"),
                  ("affine_error", "affine-test error, %", "+.3f"))
# Beside the short protocol's measures, not in its rule: no checkpoint choice touches it.
SELECTION_FREE = (("last_val_loss", "validation loss at the last step "
                   "(selection-free; descriptive)", "+.5f"),)
ALONG_MEASURES = (("test_margin_loss", "mean test margin loss (primary)", "+.5f"),
                  ("test_error", "test error, %", "+.3f"),
                  ("affine_error", "affine-test error, %", "+.3f"),
                  ("train_loss", "the epoch's training loss", "+.5f"))


@dataclasses.dataclass(frozen=True)
class Protocol:
  """A study: what its registration fixes and how its report shows it."""
  name: str                 # study/<name>/, docs/<name>.md
  title: str                # its report's (and validation plot's) title
  variants: dict            # variant: the train.py flags that make it
  measures: tuple = BEST_VALIDATION   # (key, what, format): what pairs compare
  seeds: tuple = ()         # the registered seeds (blocks); () where the user picks
  epochs: int = 0           # a run's epochs (0: the user picks)
  decay_steps: int = schedule.DECAY_STEPS   # the learning rate's decay period
  other_decays: tuple = ()  # further decay periods its runs are trained at too
  kept: tuple = ()          # epochs whose weights are kept and each scored once
  pairs: tuple = ()         # (A, B, what B - A is)
  primary: tuple = ()       # (A, B, what): the one registered hypothesis
  secondary: tuple = ()     # ((A, B, what), ...): the corrected family
  precision: str = ""       # the one precision of every run ("": the user's)
  rule: dict = dataclasses.field(default_factory=dict)   # the decision rule's figures
  unit: str = "seed"        # what pairs two runs: a seed, or a block (of seeds)
  descriptive: tuple = ()   # compared beside the measures, not part of a rule
  note: str = ""            # after the comparisons' heading
  within: bool = False      # an interval that holds zero reads "within [lo, hi]"
  task: str = tasks.DEFAULT  # the data set its runs train and are scored on
  run_flags: dict = dataclasses.field(default_factory=dict)   # train.py's, every run
  lock: str = ""            # registered: its lock file; the registration is the
                            # commit that adds it
  pilot: str = ""           # the protocol whose runs chose this design
  published: tuple = ()     # the variants of its published report (): all)

  @property
  def schedules(self):
    """Every decay period its runs are trained at, the paper's first."""
    return (self.decay_steps, *self.other_decays)

  @property
  def scores_affine(self):
    """Whether a measure is the affine-test error: its runs are then scored
    on the affine test set (a grid's: each best checkpoint, with the sweep)."""
    return any(key == "affine_error" for key, _, _ in self.measures)

  @property
  def test_sets(self):
    """The sets each kept epoch is scored on: the test set, and the affine
    test set where the task has one."""
    return ("test", "affine") if tasks.get(self.task).has_affine else ("test",)

  @property
  def test_size(self):
    """The images of the task's test set (None where the task does not say)."""
    return getattr(tasks.get(self.task), "test_size", None)


STOP_GRADIENT = Protocol("stop_gradient", "CapsNet on MNIST: routing variants", {
    "r1": dict(iter_routing=1, stop_gradient=True),
    "r2_stop": dict(iter_routing=2, stop_gradient=True),
    "r2_nostop": dict(iter_routing=2, stop_gradient=False),
    "r3_stop": dict(iter_routing=3, stop_gradient=True),
    "r3_nostop": dict(iter_routing=3, stop_gradient=False)})

# docs/table1.md: 50 epochs on the paper's schedule, best-validation checkpoint.
TABLE1 = Protocol("table1", "CapsNet on MNIST: the rows of Table 1", {
    "r1_norecon": dict(iter_routing=1, stop_gradient=True, use_decoder=False),
    "r1_recon": STOP_VARIANTS["r1_recon"],
    "r3_norecon": dict(iter_routing=3, stop_gradient=True, use_decoder=False),
    "r3_recon": STOP_VARIANTS["r3_recon"],
    "r3_recon_nostop": STOP_VARIANTS["r3_recon_nostop"],
    # The official code's loss balance (reconstruction 0.01 against the
    # summed margin loss), then also its layers; both average weights.
    "r3_recon_balance": dict(iter_routing=3, **_RECON, recon_weight=0.01,
                             ema_decay=EMA_DECAY),
    "r3_recon_official": dict(iter_routing=3, **_RECON, recon_weight=0.01,
                              capsule_layers="official", ema_decay=EMA_DECAY)},
    epochs=50, pairs=STOP_PAIRS, seeds=(0, 1, 2), other_decays=(143,),
    published=("r3_recon", "r1_recon", "r3_recon_nostop", "r3_norecon"))

# docs/short.md: the stop_gradient question in runs that fit a sitting.
SHORT = Protocol("short", "CapsNet on MNIST: the short protocol (5 epochs)", STOP_VARIANTS,
                 measures=SHORT_MEASURES, seeds=tuple(range(5)), epochs=5, decay_steps=14,
                 pairs=STOP_PAIRS,
                 unit="block", descriptive=SELECTION_FREE, within=True,
                 note=" (nine intervals at 95% each, not corrected for multiplicity)")

# docs/along.md: the question along training, no checkpoint selection.
ALONG = Protocol("along", "The stop_gradient question along training (docs/along.md)",
                 STOP_VARIANTS, measures=ALONG_MEASURES, seeds=tuple(range(0, 5)), epochs=10,
                 kept=(1, 2, 5, 10), pairs=STOP_PAIRS, unit="block",
                 run_flags={"diag_every": 100, "val_every": 0})

# docs/confirm.md: sixteen fresh blocks of the along protocol (n fixed by the
# power to call 0.06 points), fp32, 48 runs in a registered sequence; the
# primary and the Holm-corrected secondary pair on the test error at epoch 10.
CONFIRM = dataclasses.replace(
    ALONG, name="confirm", title="The stop_gradient question, confirmatory (docs/confirm.md)",
    seeds=tuple(range(5, 21)), primary=STOP_PAIRS[0], secondary=STOP_PAIRS[1:],
    precision="fp32", lock="docs/confirm.lock", pilot=ALONG.name, rule={
        "measure": "test_error", "epoch": 10, "alpha": 0.05,
        "margin": 0.06,              # equivalence: the 90% interval inside +-0.06 points
        "margin_descriptive": 0.10,  # the same test, reported beside it
        "power": {"effect": 0.06, "target": 0.80},
        "order_seed": 20261205,      # the shuffle of the blocks' orders
        # the claim: the secondary pairs' signs it predicts (+1: B - A > 0)
        "claim": {"text": "with the stop r = 3 beats r = 1, without it r = 1 beats r = 3",
                  "signs": (-1, +1)},
        # the verdict's words: a called primary, an equivalence shown
        "says": {"a_lower": "the stop gives the lower test error",
                 "b_lower": "turning the stop off gives the lower test error",
                 "subject": "the stop"}})

# Section 6: an epoch is 55,000 pairs drawn on the fly.
MULTIMNIST = Protocol("multimnist", "CapsNet on MultiMNIST (both digits right)", {
    "r3_recon": dict(STOP_VARIANTS["r3_recon"], dataset="multimnist")}, seeds=(0,), epochs=14)

PROTOCOLS = {p.name: p for p in (STOP_GRADIENT, TABLE1, SHORT, ALONG, CONFIRM, MULTIMNIST)}
