"""Stopping a training run on a signal: finish the step, save, exit with
128 + the signal's number; a second signal quits at once, but never in the
middle of writing a checkpoint."""
import contextlib
import signal

import tqdm

# The signals that stop a run with a checkpoint: Ctrl-C, and what a machine
# sends (SIGTERM: kill, a batch scheduler's preemption, docker stop, a
# Kubernetes eviction, systemd; SIGHUP: a closed terminal).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Quit(KeyboardInterrupt):
  """A second stop signal: quit at once, without a checkpoint (a
  KeyboardInterrupt, so that no `except Exception` on the way catches it)."""

  def __init__(self, signum):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopRequest:
  """A stop signal once: stop after this step, save, exit with 128 + its number;
  twice: quit at once, but never mid-checkpoint. With `relay` (a cluster's
  non-chief worker) a first signal is only noted (`signum`), passed on to the
  chief, and training goes on until the chief stops the run."""

  def __init__(self, relay=False):
    self.requested = False
    self.signum = None
    self.saving = False
    self.quit_after_save = None
    self.relay = relay
    self.relayed = False   # passed on to the chief (relay=True)

  @property
  def exit_status(self):
    return 128 + self.signum

  def __call__(self, signum, frame):
    if self.requested and self.saving:
      self.quit_after_save = signum
    elif self.requested or self.signum is not None:
      raise Quit(signum)
    elif self.relay:
      self.signum = signum
      tqdm.tqdm.write(f"{signal.Signals(signum).name}: asking the chief to save and "
                      "stop the run (Ctrl-C again to quit at once)")
    else:
      self.requested, self.signum = True, signum
      tqdm.tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint at the end "
                      "of this step (Ctrl-C again to quit without saving)")

  def passed_on(self, signum, who):
    """The chief: a stop signal that `who` passed on; as if it came here."""
    if not self.requested:
      self.requested, self.signum = True, signum
      tqdm.tqdm.write(f"{signal.Signals(signum).name} to {who}: saving a checkpoint "
                      "at the end of this step")

  @contextlib.contextmanager
  def deferred(self):
    """A second signal inside waits until the block is done."""
    self.saving = True
    try:
      yield
    finally:
      self.saving = False
    if self.quit_after_save is not None:
      raise Quit(self.quit_after_save)

  @contextlib.contextmanager
  def installed(self):
    """Handles `STOP_SIGNALS` inside; after, the previous handlers come back,
    unless a stop signal came: then the run is saved or quitting, and a later
    signal (one still pending included) changes nothing."""
    previous = {sig: signal.signal(sig, self) for sig in STOP_SIGNALS}
    try:
      yield self
    finally:
      stopped = self.requested or self.signum is not None
      for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_IGN if stopped else handler)
