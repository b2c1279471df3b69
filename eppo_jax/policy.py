"""The model as an `agent.Policy`: `rollout` pmapped over local devices, the cache kept on device."""

from __future__ import annotations

import functools

import jax
import numpy as np

from eppo_jax import parallel
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import init_cache
from eppo_jax.sampling import SamplingConfig, rollout


def _turn(params, tokens, mask, rng, cache, *, config, sampling):
  out = rollout(params, config, tokens, mask, rng, sampling, cache=cache)
  return out.tokens, out.mask, out.cache, (out.logprobs, out.entropies)


@functools.lru_cache(maxsize=None)
def _compiled(config: ModelConfig, sampling: SamplingConfig, batch: int, max_len: int):
  """(empty-cache maker, one-turn function), pmapped; built once per static setting."""
  # The empty cache is made by its own program and passed in: allocated inside the turn program,
  # its zeros would be constants that XLA tries to fold through the attention (slow compiles).
  empty = jax.pmap(lambda _: init_cache(config, batch, max_len), axis_name=parallel.AXIS)
  turn = jax.pmap(functools.partial(_turn, config=config, sampling=sampling),
                  axis_name=parallel.AXIS, donate_argnums=(4,))
  return empty, turn


class ModelPolicy:
  """Continues a batch of conversations by one assistant turn per call (see `agent.Policy`).

  `params` are replicated over the local devices. Rows are padded with inactive (empty) rows to a
  multiple of the device count, and each device draws from its own key.
  """

  def __init__(self, params, config: ModelConfig, sampling: SamplingConfig, max_slots: int,
               rng: jax.Array):
    self._params = params
    self._config, self._sampling, self._max_slots = config, sampling, max_slots
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
    empty, turn = _compiled(self._config, self._sampling, padded // self._devices,
                            self._max_slots)
    cache = empty(np.zeros(self._devices)) if state is None else state
    reply, reply_mask, cache, scores = turn(self._params, tokens, mask, self._keys(), cache)
    self._turn += 1
    reply, reply_mask, scores = parallel.unshard((reply, reply_mask, scores))
    return reply[:b], reply_mask[:b], cache, tuple(x[:b] for x in scores)
