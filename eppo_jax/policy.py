"""The model as an `agent.Policy`: `rollout` pmapped over the local devices, cache kept on device."""

from __future__ import annotations

import functools

import jax
import numpy as np

from eppo_jax import parallel
from eppo_jax.models.config import ModelConfig
from eppo_jax.sampling import SamplingConfig, rollout


def _first_turn(params, tokens, mask, rng, *, config, sampling, max_len):
  out = rollout(params, config, tokens, mask, rng, sampling, max_len=max_len)
  return out.tokens, out.mask, out.cache


def _next_turn(params, tokens, mask, rng, cache, *, config, sampling):
  out = rollout(params, config, tokens, mask, rng, sampling, cache=cache)
  return out.tokens, out.mask, out.cache


@functools.lru_cache(maxsize=None)
def _compiled(config: ModelConfig, sampling: SamplingConfig, max_len: int):
  """The pmapped turn functions, built once per static setting (so jit caches are reused)."""
  first = jax.pmap(functools.partial(_first_turn, config=config, sampling=sampling,
                                     max_len=max_len), axis_name=parallel.AXIS)
  later = jax.pmap(functools.partial(_next_turn, config=config, sampling=sampling),
                   axis_name=parallel.AXIS, donate_argnums=(4,))
  return first, later


class ModelPolicy:
  """Continues a batch of conversations by one assistant turn per call (see `agent.Policy`).

  `params` are replicated over the local devices. Rows are padded with inactive (empty) rows to a
  multiple of the device count, and each device draws from its own key.
  """

  def __init__(self, params, config: ModelConfig, sampling: SamplingConfig, max_slots: int,
               rng: jax.Array):
    self._params = params
    self._first, self._later = _compiled(config, sampling, max_slots)
    self._rng = rng
    self._turn = 0
    self._devices = jax.local_device_count()

  def _keys(self):
    """One key per local device, distinct across turns, devices and hosts."""
    turn_key = jax.random.fold_in(self._rng, self._turn)
    first = jax.process_index() * self._devices
    return np.stack([np.asarray(jax.random.fold_in(turn_key, first + d))
                     for d in range(self._devices)])

  def __call__(self, chunk_BxC, chunk_mask_BxC, state, active_B):
    del active_B  # Inactive rows already have an empty chunk, which rollout treats as finished.
    b = chunk_BxC.shape[0]
    padded = -(-b // self._devices) * self._devices
    if padded != b:
      extra = padded - b
      chunk_BxC = np.concatenate([chunk_BxC, np.zeros((extra,) + chunk_BxC.shape[1:],
                                                      chunk_BxC.dtype)])
      chunk_mask_BxC = np.concatenate([chunk_mask_BxC, np.zeros((extra,) + chunk_mask_BxC.shape[1:],
                                                                bool)])
    tokens, mask = parallel.shard((chunk_BxC, chunk_mask_BxC))
    if state is None:
      reply, reply_mask, cache = self._first(self._params, tokens, mask, self._keys())
    else:
      reply, reply_mask, cache = self._later(self._params, tokens, mask, self._keys(), state)
    self._turn += 1
    reply, reply_mask = parallel.unshard((reply, reply_mask))
    return reply[:b], reply_mask[:b], cache
