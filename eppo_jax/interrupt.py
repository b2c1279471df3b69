"""SIGINT / SIGTERM (Ctrl-C, TPU VM preemption) as a request to stop after the current step.

While a `StopRequest` is active, the first signal only sets a flag: the training loop finishes the
step it is in, saves a checkpoint and raises `Interrupted`, and a rerun of the same command resumes
from there. A second Ctrl-C abandons the step at once (KeyboardInterrupt), losing the work since the
last checkpoint, for when even one step is too long to wait for; so does a second SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
  """The run stopped on a signal after saving a checkpoint; `signum` says which."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class StopRequest:
  """Context manager that turns SIGINT / SIGTERM into `self.signum` (None until one arrives).

  Handlers can only be installed from the main thread; elsewhere it is inert (signals keep their
  handlers) and `signum` stays None.
  """

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum else ""

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signum is not None:
      raise KeyboardInterrupt(f"second signal ({signal.Signals(signum).name}): the current step "
                              "is abandoned, not saved")
    self.signum = signum
    log.warning("%s received: finishing the current step, then saving a checkpoint and stopping "
                "(a second signal abandons the step)", signal.Signals(signum).name)
