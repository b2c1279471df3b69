"""Orbax checkpoints of the whole training state, so that a resumed run continues bit for bit.

Arrays (trainable params, optimizer state, pacing state, step) go through `StandardSave` as they
are: global `jax.Array`s sharded over the device mesh are written by every host for the shards it
owns (orbax stores the global array, not the layout), NumPy arrays as they are. `restore` reads them
back onto whatever shardings its `like` tree carries, so a checkpoint written on one mesh restores
on another (or as NumPy). Host-side state (task-sampler position, metrics history) goes in a JSON
item next to them. Orbax writes each step to a temporary directory and renames it when complete,
so a kill during a save leaves the previous checkpoint as the latest usable one. A checkpoint
damaged afterwards (a truncated or deleted file) is reported in one line by `restore_intact`, which
falls back to the newest one that reads back on every host: all hosts restore the same step.

The directory is local or a URL (gs://bucket/run/checkpoints), reached through `etils.epath`; on
GCS orbax marks a finished step with a commit file instead of the rename.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import zlib
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from eppo_jax import hosts, workdir as workdir_lib

log = logging.getLogger(__name__)


# The barrier that ends every orbax restore (`Checkpointer.restore`); a host whose read failed
# before it joins it too, so that the hosts whose read worked are not left waiting in it.
_RESTORE_BARRIER = "Checkpointer:restore"


class NoIntactCheckpoint(RuntimeError):
  """Every checkpoint of a directory failed to read."""


class HostsDisagree(RuntimeError):
  """The hosts see different checkpoints: the directory is not one they all share."""


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
    self.directory = workdir_lib.absolute(directory)
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
    """(step, state, meta) of the newest checkpoint that reads back on every host; (None, None, {})
    if there is none. Each unreadable one is reported in one warning line naming it.

    Called by all hosts together: a step one host cannot read is passed over by all of them.
    """
    steps = self.all_steps()
    self._check_hosts_agree(steps)
    for step in reversed(steps):
      error = None
      try:
        with _quiet_orbax():
          state, meta = self.restore(like, step)
      except Exception as e:  # Any failure to read means: damaged; the reason goes in the line.
        error = e
        if jax.process_count() > 1:
          ocp.multihost.sync_global_processes(_RESTORE_BARRIER)
      if not hosts.global_max(int(error is not None)):  # It read back on every host.
        if step != steps[-1]:
          self._set_aside([s for s in steps if s > step])
        return step, state, meta
      if error is None:
        reason = "it read back here, not on every host"
      else:
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
      log.warning("checkpoint %s is unreadable (%s); falling back to an older one",
                  self.directory / str(step), reason)
    if steps:
      raise NoIntactCheckpoint(f"none of the checkpoints {steps} under {self.directory} can be "
                               "read (see the warnings above); move them away to start over")
    return None, None, {}

  def _check_hosts_agree(self, steps: list[int]) -> None:
    """Raises `HostsDisagree` on every host unless all hosts list the same steps (a workdir on
    each host's own disk would let each resume its own run)."""
    # 30 bits: the collective carries int32 (without x64), negated too.
    digest = zlib.crc32(",".join(map(str, steps)).encode()) & 0x3FFFFFFF
    if hosts.global_max(digest) != -hosts.global_max(-digest):
      raise HostsDisagree(f"the hosts see different checkpoints under {self.directory} ({steps} on "
                          f"host {jax.process_index()}): the workdir must be one directory that "
                          "all hosts share, such as a gs:// URL")

  def _set_aside(self, steps: list[int]) -> None:
    """Moves unreadable checkpoints to `<directory>.unreadable/`, so that new saves after the
    fallback step are not mistaken for older than them (kept for inspection, not deleted).

    Process 0 moves them; every host waits for it before listing the directory again.
    """
    self._manager.close()
    if jax.process_index() == 0:
      aside = self.directory.parent / (self.directory.name + ".unreadable")
      aside.mkdir(parents=True, exist_ok=True)
      # A file, so that the folder exists on an object store too (a rename needs its target's).
      (aside / "README.txt").write_text("Checkpoints that did not read back, kept to inspect.\n")
      for step in steps:
        target = aside / str(step)
        if target.exists():
          target.rmtree()
        (self.directory / str(step)).rename(target)
    hosts.barrier("checkpoint_set_aside")
    self._manager = self._new_manager()

  def close(self) -> None:
    self._manager.close()
