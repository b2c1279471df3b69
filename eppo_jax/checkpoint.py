"""Orbax checkpoints of the whole training state, so that a resumed run continues bit for bit.

Arrays (trainable params, optimizer state, pacing state, step) go through `StandardSave` as they
are: global `jax.Array`s sharded over the device mesh are written by every host for the shards it
owns (orbax stores the global array, not the layout), NumPy arrays as they are. `restore` reads them
back onto whatever shardings its `like` tree carries, so a checkpoint written on one mesh restores
on another (or as NumPy). Host-side state (task-sampler position, metrics history) goes in a JSON
item next to them. Orbax writes each step to a temporary directory and renames it when complete,
so a kill during a save leaves the previous checkpoint as the latest usable one. A checkpoint
damaged afterwards (a truncated or deleted file) is reported in one line by `restore_intact`, which
falls back to the newest one that reads back on every host: all hosts restore the same step. A read
that fails for a reason outside the files (out of memory, a storage service that times out or is
unavailable) is retried, and if it keeps failing the run stops with every checkpoint left in place.

The directory is local or a URL (gs://bucket/run/checkpoints), reached through `etils.epath`; on
GCS orbax marks a finished step with a commit file instead of the rename.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import re
import sys
import time
import zlib
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from eppo_jax import hosts, workdir as workdir_lib

log = logging.getLogger(__name__)


# Outcomes of one attempt to read a checkpoint, ordered: the hosts agree on the largest.
_READ, _DAMAGED, _FAILED = 0, 1, 2
_ATTEMPTS = 3  # Reads of a checkpoint before a failure that is not damage stops the run.
_RETRY_S = 5.0  # Wait before the second attempt; doubled before each further one.
# Failures of the reading, not of the files: memory, and a storage service's transient answers
# (tensorstore and gRPC status names, HTTP 429 / 5xx wording).
_TRANSIENT = re.compile(r"\b(RESOURCE_EXHAUSTED|UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|CANCELLED)\b|"
                        r"out of memory|timed? ?out|too many requests|service unavailable|"
                        r"connection (reset|refused|aborted)|temporarily", re.IGNORECASE)
_TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                     errno.EAGAIN, errno.ENOMEM, errno.EHOSTUNREACH, errno.ENETUNREACH,
                     errno.ENETDOWN, errno.EINTR}


def read_failure(error: BaseException) -> int:
  """`_FAILED` if `error` says the reading failed (memory, the storage service, the network) and
  may not fail again, else `_DAMAGED`: missing, truncated or inconsistent files."""
  if isinstance(error, (MemoryError, TimeoutError, ConnectionError)):
    return _FAILED
  if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
    return _FAILED
  return _FAILED if _TRANSIENT.search(str(error)) else _DAMAGED


class NoIntactCheckpoint(RuntimeError):
  """Every checkpoint of a directory failed to read."""


class HostsDisagree(RuntimeError):
  """The hosts see different checkpoints: the directory is not one they all share."""


class CheckpointReadFailed(RuntimeError):
  """A checkpoint could not be read for a reason other than damage, on every attempt."""


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

  def update_meta(self, step: int, meta: dict) -> None:
    """Rewrites the meta of checkpoint `step`, its arrays untouched: for what changed after the
    save, such as an evaluation that completed. Process 0 writes it, as orbax's JsonSave does,
    through a temporary file, so a crash leaves the old meta or the new one, never a part."""
    if jax.process_index() == 0:
      path = self.directory / str(step) / "meta" / "metadata"  # JsonSave's file.
      partial = path.with_name("metadata.partial")
      partial.write_text(json.dumps(meta))
      partial.replace(path)

  def restore(self, like: Any, step: Optional[int] = None) -> tuple[Any, dict]:
    """Restores arrays shaped like `like`, on its leaves' shardings; the latest step by default.

    `like` may hold jax Arrays or ShapeDtypeStructs with shardings (restored sharded that way,
    whatever mesh wrote the checkpoint) or NumPy arrays (restored in full on every host).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    abstract = jax.tree_util.tree_map(_abstract, like)
    # orbax's handler, not its Checkpointer: the Checkpointer ends a restore in a barrier of all
    # hosts, which a host whose read failed would never reach. Hosts that restore together
    # agree afterwards (`restore_intact`).
    handler = ocp.CompositeCheckpointHandler()
    try:
      restored = handler.restore(self.directory / str(step), ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    finally:
      handler.close()
    return restored["state"], restored["meta"]

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore_intact(self, like: Any) -> tuple[Optional[int], Any, dict]:
    """(step, state, meta) of the newest checkpoint that reads back on every host; (None, None, {})
    if there is none. Each damaged one is reported in one warning line naming it and set aside.

    Called by all hosts together: a step one host cannot read is passed over by all of them. A
    read that fails for another reason than damage (`read_failure`) on any host is retried by all
    (`_ATTEMPTS` in all); if it still fails, every host raises `CheckpointReadFailed` and nothing
    is set aside.
    """
    steps = self.all_steps()
    self._check_hosts_agree(steps)
    for step in reversed(steps):
      for attempt in range(_ATTEMPTS):
        outcome, error, state, meta = self._try_restore(like, step)
        agreed = hosts.global_max(outcome)
        if agreed != _FAILED or attempt == _ATTEMPTS - 1:
          break
        wait = _RETRY_S * 2 ** attempt
        log.warning("checkpoint %s: reading failed (%s); attempt %d of %d in %.0f s",
                    self.directory / str(step), _reason(error, "on another host"), attempt + 2,
                    _ATTEMPTS, wait)
        time.sleep(wait)
      if agreed == _READ:
        if step != steps[-1]:
          self._set_aside([s for s in steps if s > step])
        return step, state, meta
      if agreed == _FAILED:
        raise CheckpointReadFailed(
            f"checkpoint {self.directory / str(step)} could not be read in {_ATTEMPTS} attempts "
            f"({_reason(error, 'on another host')}); it is not damaged as far as can be told and "
            "was left in place: rerun when the cause is gone")
      log.warning("checkpoint %s is unreadable (%s); falling back to an older one",
                  self.directory / str(step), _reason(error, "it read back here, not on every host"))
    if steps:
      raise NoIntactCheckpoint(f"none of the checkpoints {steps} under {self.directory} can be "
                               "read (see the warnings above); move them away to start over")
    return None, None, {}

  def _try_restore(self, like: Any, step: int) -> tuple[int, Optional[BaseException], Any, dict]:
    """(outcome, error, state, meta) of one attempt to read `step` on this host."""
    try:
      with _quiet_orbax():
        state, meta = self.restore(like, step)
      return _READ, None, state, meta
    except Exception as e:  # pylint: disable=broad-exception-caught
      return read_failure(e), e, None, {}

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


def _reason(error: Optional[BaseException], otherwise: str) -> str:
  """`Type: first line` of `error` (200 characters at most), or `otherwise` when there is none."""
  if error is None:
    return otherwise
  return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
