"""Orbax checkpoints of the whole training state, so that a resumed run continues bit for bit.

Arrays (trainable params, optimizer state, pacing state, step) go through `StandardSave` as they
are: global `jax.Array`s sharded over the device mesh are written by every host for the shards it
owns (orbax stores the global array, not the layout), NumPy arrays as they are. `restore` reads them
back onto whatever shardings its `like` tree carries, so a checkpoint written on one mesh restores
on another (or as NumPy). Host-side state (task-sampler position, metrics history) goes in a JSON
item next to them. Orbax writes each step to a temporary directory and renames it when complete,
so a kill during a save leaves the previous checkpoint as the latest usable one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


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
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
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

  def close(self) -> None:
    self._manager.close()
