"""The model as an `agent.Policy`: one jitted rollout turn over the device mesh, the cache on device."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np

from eppo_jax import mesh as meshlib
from eppo_jax import parallel
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import init_cache
from eppo_jax.sampling import SamplingConfig, rollout


def _turn(params, tokens, mask, rng, cache, *, config, sampling):
  out = rollout(params, config, tokens, mask, rng, sampling, cache=cache)
  return out.tokens, out.mask, out.cache


@functools.lru_cache(maxsize=None)
def compiled_turn(config: ModelConfig, sampling: SamplingConfig, mesh: jax.sharding.Mesh,
                  batch: int, max_len: int):
  """(empty-cache maker, one-turn function) for a global batch of `batch` rows, jitted on `mesh`.

  The params keep the shardings they were placed with (`mesh.shardings`); rows and the cache are
  split over data x fsdp, kv heads over tensor (`mesh.cache_shardings`).
  """
  cache_sh = meshlib.cache_shardings(mesh, config.num_kv_heads)
  rows = meshlib.batch_sharding(mesh)
  # The empty cache is made by its own program and passed in: allocated inside the turn program,
  # its zeros would be constants that XLA tries to fold through the attention (slow compiles).
  empty = jax.jit(lambda: init_cache(config, batch, max_len), out_shardings=cache_sh)
  turn = jax.jit(functools.partial(_turn, config=config, sampling=sampling),
                 in_shardings=(None, rows, rows, meshlib.replicated(mesh), cache_sh),
                 out_shardings=(rows, rows, cache_sh), donate_argnums=(4,))
  return empty, turn


class ModelPolicy:
  """Continues a batch of conversations by one assistant turn per call (see `agent.Policy`).

  `params` are global arrays on `mesh` (default: a data-parallel mesh over every device). Each
  host passes its own rows, padded with inactive (empty) rows to a multiple of its batch shards.
  One key per turn draws for the whole global batch, so the samples do not depend on the mesh.
  """

  def __init__(self, params, config: ModelConfig, sampling: SamplingConfig, max_slots: int,
               rng: jax.Array, mesh: Optional[jax.sharding.Mesh] = None):
    self._mesh = mesh or meshlib.make_mesh(meshlib.DATA_ONLY)
    self._params = params
    self._config, self._sampling, self._max_slots = config, sampling, max_slots
    self._rng = rng
    self._turn = 0
    self._shards = max(1, meshlib.batch_shards(self._mesh) // jax.process_count())

  def __call__(self, chunk_BxC, chunk_mask_BxC, state, active_B):
    del active_B  # Inactive rows already have an empty chunk, which rollout treats as finished.
    b, c = chunk_BxC.shape
    # Every host must pass the same shape (a global array): hosts with fewer rows (an uneven
    # evaluation split) or a shorter chunk add empty rows and left padding.
    padded = parallel.global_max(-(-b // self._shards) * self._shards)
    width = parallel.global_max(c)
    pads = ((0, padded - b), (width - c, 0))
    chunk_BxC, chunk_mask_BxC = np.pad(chunk_BxC, pads), np.pad(chunk_mask_BxC, pads)
    tokens, mask = meshlib.put_rows((chunk_BxC, chunk_mask_BxC), self._mesh)
    empty, turn = compiled_turn(self._config, self._sampling, self._mesh,
                                padded * jax.process_count(), self._max_slots)
    key = jax.random.fold_in(self._rng, self._turn)
    with jax.set_mesh(self._mesh):  # Traced with the mesh in context: see `mesh.constrain_rows`.
      cache = empty() if state is None else state
      reply, reply_mask, cache = turn(self._params, tokens, mask, key, cache)
    self._turn += 1
    reply, reply_mask = meshlib.local_rows((reply, reply_mask), self._mesh)
    return reply[:b], reply_mask[:b], cache
