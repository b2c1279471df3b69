"""Orbax checkpoints of the whole training state, so that a resumed run continues bit for bit.

Arrays (trainable params, optimizer state, pacing state, step) go through `StandardSave` as they
are: global `jax.Array`s sharded over the device mesh are written by every host for the shards it
owns (orbax stores the global array, not the layout), NumPy arrays as they are. `restore` reads them
back onto whatever shardings its `like` tree carries, so a checkpoint written on one mesh restores
on another (or as NumPy). Host-side state (task-sampler position, metrics history) goes in a JSON
item next to them. Orbax writes each step to a temporary directory and renames it when complete,
so a kill during a save leaves the previous checkpoint as the latest usable one. A checkpoint
damaged afterwards (a truncated or deleted file) is reported in one line by `restore_intact`, which
falls back to the newest one that reads back.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class NoIntactCheckpoint(RuntimeError):
  """Every checkpoint of a directory failed to read."""


def _drop_closed_loop_errors(unraisable) -> None:
  """An unraisable-exception hook that drops asyncio's "Event loop is closed" only."""
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return
  _previous_hook(unraisable)


_previous_hook = sys.unraisablehook


@contextlib.contextmanager
def _quiet_orbax():
  """Mutes orbax's and asyncio's error logs while a restore may fail: a damaged checkpoint makes
  them log dozens of "Event loop is closed" tracebacks for one cause, reported once by the caller.
  Those come late, from callbacks of the aborted reads, so that hook stays installed."""
  sys.unraisablehook = _drop_closed_loop_errors
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio", "orbax")]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def _abstract(x):
  """Restore target of one leaf: the same global shape and dtype on the same sharding."""
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  return np.zeros(np.shape(x), np.asarray(x).dtype)  # NumPy in, NumPy out.


class Checkpointer:
  """Keeps the last `keep` checkpoints under `directory`."""

  def __init__(self, directory, keep: int = 2):
    self.directory = Path(directory).absolute()
    self.keep = keep
    self._manager = self._new_manager()

  def _new_manager(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Saves `state` (a pytree of arrays) and `meta` (JSON-serialisable) as checkpoint `step`."""
    state = jax.tree_util.tree_map(lambda x: x if isinstance(x, jax.Array) else np.asarray(x),
                                   state)
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, like: Any, step: Optional[int] = None) -> tuple[Any, dict]:
    """Restores arrays shaped like `like`, on its leaves' shardings; the latest step by default.

    `like` may hold jax Arrays or ShapeDtypeStructs with shardings (restored sharded that way,
    whatever mesh wrote the checkpoint) or NumPy arrays (restored in full on every host).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    abstract = jax.tree_util.tree_map(_abstract, like)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore_intact(self, like: Any) -> tuple[Optional[int], Any, dict]:
    """(step, state, meta) of the newest checkpoint that reads back; (None, None, {}) if there is
    none. Each unreadable one is reported in one warning line naming it."""
    steps = self.all_steps()
    for step in reversed(steps):
      try:
        with _quiet_orbax():
          state, meta = self.restore(like, step)
      except Exception as e:  # Any failure to read means: damaged; the reason goes in the line.
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        log.warning("checkpoint %s is unreadable (%s: %s); falling back to an older one",
                    self.directory / str(step), type(e).__name__, reason)
        continue
      if step != steps[-1]:
        self._set_aside([s for s in steps if s > step])
      return step, state, meta
    if steps:
      raise NoIntactCheckpoint(f"none of the checkpoints {steps} under {self.directory} can be "
                               "read (see the warnings above); move them away to start over")
    return None, None, {}

  def _set_aside(self, steps: list[int]) -> None:
    """Moves unreadable checkpoints to `<directory>.unreadable/`, so that new saves after the
    fallback step are not mistaken for older than them (kept for inspection, not deleted)."""
    if jax.process_index() == 0:
      aside = self.directory.with_name(self.directory.name + ".unreadable")
      aside.mkdir(exist_ok=True)
      for step in steps:
        target = aside / str(step)
        if target.exists():
          shutil.rmtree(target)
        shutil.move(str(self.directory / str(step)), str(target))
    self._manager.close()
    self._manager = self._new_manager()

  def close(self) -> None:
    self._manager.close()
