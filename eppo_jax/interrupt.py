"""SIGINT / SIGTERM (Ctrl-C, TPU VM preemption) as a request to stop at the next phase boundary.

While a `StopRequest` is active, the first signal only sets a flag. The training loop checks it
(every host agreeing) at each turn of play and evaluation, after play, after the update and at
each SFT step: it saves the last completed RL step, skipping a due evaluation (the resumed run
does it), and raises `Interrupted`; a rerun of the same command resumes from there. A second
Ctrl-C abandons everything at once (KeyboardInterrupt), losing the work since the last checkpoint;
so does a second SIGTERM.

A signal sent to the whole process group (`timeout`, Slurm's `scancel`, most job runners) also
reaches the compiler processes XLA starts (`ptxas` on NVIDIA GPUs), and the compilation in flight
fails; `retry_if_stopping` compiles such a program again.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading

import jax

log = logging.getLogger(__name__)
_active: list["StopRequest"] = []  # The StopRequests entered and not exited, innermost last.

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
  """The run stopped on a signal after saving a checkpoint; `signum` says which."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class StopNow(Exception):
  """Every host agreed to stop in the middle of a phase (play, evaluation, SFT) on `signum`."""

  def __init__(self, signum: int):
    super().__init__(f"stopping on {signal.Signals(signum).name}")
    self.signum = signum


def pending() -> int:
  """The signal that an active `StopRequest` of this process received, or 0."""
  return next((r.signum for r in reversed(_active) if r.signum), 0)


def retry_if_stopping(program):
  """`program` (a jitted function), called once more if it fails with an XLA runtime error while a
  stop is pending and none of its arguments was consumed (donated buffers are deleted only once
  it ran): the error was the compilation's, whose compiler the signal ended."""
  @functools.wraps(program)
  def call(*args, **kwargs):
    try:
      return program(*args, **kwargs)
    except jax.errors.JaxRuntimeError as error:
      leaves = jax.tree_util.tree_leaves((args, kwargs))
      if not pending() or any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        raise
      log.warning("a device program failed while stopping (%s): compiling it again",
                  str(error).splitlines()[0][:200])
      return program(*args, **kwargs)
  return call


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
    _active.append(self)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
    _active.remove(self)

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum else ""

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signum is not None:
      raise KeyboardInterrupt(f"second signal ({signal.Signals(signum).name}): the current step "
                              "is abandoned, not saved")
    self.signum = signum
    log.warning("%s received: stopping at the next phase boundary with a checkpoint of the last "
                "completed step (a second signal stops at once, unsaved)",
                signal.Signals(signum).name)
