"""Orbax checkpoints of the whole training state, so that a resumed run continues bit for bit.

Arrays (trainable params, optimizer state, pacing state, step) go through `StandardSave` as host
NumPy arrays: the state is replicated, and on a multi-host job orbax refuses host-local device arrays
(what pmap gives) but writes replicated NumPy arrays once, from the first process. Host-side state
(task-sampler position, metrics history) goes in a JSON item next to them. Orbax writes each
step to a temporary directory and renames it when complete, so a kill during a save leaves the
previous checkpoint as the latest usable one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` checkpoints under `directory`."""

  def __init__(self, directory, keep: int = 2):
    self.directory = Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Saves `state` (a pytree of arrays) and `meta` (JSON-serialisable) as checkpoint `step`."""
    state = jax.tree_util.tree_map(np.asarray, jax.device_get(state))
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, like: Any, step: Optional[int] = None) -> tuple[Any, dict]:
    """Restores NumPy arrays shaped like `like` (a pytree); the latest step by default."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    # NumPy targets: every process reads the full replicated arrays, whatever devices it has.
    abstract = jax.tree_util.tree_map(lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), like)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

  def close(self) -> None:
    self._manager.close()
