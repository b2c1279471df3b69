"""The model as an `agent.Policy`: `rollout` pmapped over local devices, the cache kept on device."""

from __future__ import annotations

import functools

import jax
import numpy as np

from eppo_jax import parallel
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import init_cache
from eppo_jax.sampling import SamplingConfig, prefix_bucket, rollout


def _turn(params, tokens, mask, rng, cache, *, config, sampling, prefix):
  out = rollout(params, config, tokens, mask, rng, sampling, cache=cache, prefix=prefix)
  return out.tokens, out.mask, out.cache


def _take_rows(cache, rows_b):
  """The cache of the rows `rows_b` (a device's rows, in its own numbering), in that order."""
  return {**cache, "k": cache["k"][:, rows_b], "v": cache["v"][:, rows_b],
          "mask": cache["mask"][rows_b], "pos": cache["pos"][rows_b]}


@functools.lru_cache(maxsize=None)
def _empty(config: ModelConfig, batch: int, max_len: int):
  """Pmapped maker of an empty cache of `batch` rows per device."""
  # The empty cache is made by its own program and passed in: allocated inside the turn program,
  # its zeros would be constants that XLA tries to fold through the attention (slow compiles).
  return jax.pmap(lambda _: init_cache(config, batch, max_len), axis_name=parallel.AXIS)


@functools.lru_cache(maxsize=None)
def _compiled(config: ModelConfig, sampling: SamplingConfig, prefix: int):
  """The pmapped one-turn function for a static attention prefix; one program per batch shape."""
  return jax.pmap(functools.partial(_turn, config=config, sampling=sampling, prefix=prefix),
                  axis_name=parallel.AXIS, donate_argnums=(4,))


_compact = jax.pmap(_take_rows, axis_name=parallel.AXIS)


class ModelPolicy:
  """Continues a batch of conversations by one assistant turn per call (see `agent.Policy`).

  `params` are replicated over the local devices. Episodes are dealt to devices in order, padded
  with inactive (empty) rows to a multiple of the device count; each device draws from its own key.

  Cost follows use. Each turn attends over a bucketed prefix of the cache that covers the slots
  written so far (counted here on the host, see `sampling.prefix_bucket`). With `compact`, once
  the live episodes of every device fit a smaller power-of-two batch, each device gathers its live
  rows of the cache into that batch, so later turns run on live rows only; an episode stays on
  its device. Greedy episodes are unchanged by compaction; sampled ones draw from other random
  streams (a row's draw depends on its position in the batch), with the same distribution.
  """

  def __init__(self, params, config: ModelConfig, sampling: SamplingConfig, max_slots: int,
               rng: jax.Array, compact: bool = True):
    self._params = params
    self._config, self._sampling, self._max_slots = config, sampling, max_slots
    self._rng = rng
    self._compact = compact
    self._turn = 0
    self._devices = jax.local_device_count()
    self._rows_DxR = None  # Episode row held by each (device, cache row); -1 for an empty row.
    self._used = 0  # Cache slots written so far, an upper bound of every device's index.

  def _keys(self):
    """One key per local device, distinct across turns, devices and hosts."""
    turn_key = jax.random.fold_in(self._rng, self._turn)
    first = jax.process_index() * self._devices
    return np.stack([np.asarray(jax.random.fold_in(turn_key, first + d))
                     for d in range(self._devices)])

  def _maybe_compact(self, cache, active_B):
    """Gathers each device's live rows into a smaller batch when they fit one."""
    rows_DxR = self._rows_DxR
    live_DxR = (rows_DxR >= 0) & active_B[np.maximum(rows_DxR, 0)]
    most = max(int(live_DxR.sum(axis=1).max()), 1)
    smaller = 1 << (most - 1).bit_length()  # The power of two that holds the busiest device.
    if smaller >= rows_DxR.shape[1]:
      return cache
    keep_DxR = np.zeros((self._devices, smaller), np.int32)
    new_rows_DxR = np.full((self._devices, smaller), -1, np.int64)
    for d in range(self._devices):
      live = np.flatnonzero(live_DxR[d])
      dead = np.flatnonzero(~live_DxR[d])
      # Live rows first; dead rows fill the rest (their chunks are empty from now on).
      keep_DxR[d] = np.concatenate([live, dead])[:smaller]
      new_rows_DxR[d, :len(live)] = rows_DxR[d, live]
    self._rows_DxR = new_rows_DxR
    return _compact(cache, keep_DxR)

  def __call__(self, chunk_BxC, chunk_mask_BxC, state, active_B):
    b, c = chunk_BxC.shape
    n = self._sampling.max_new_tokens
    if state is None:
      per_device = -(-b // self._devices)
      rows = np.arange(self._devices * per_device)
      self._rows_DxR = np.where(rows < b, rows, -1).reshape(self._devices, per_device)
      self._used = 0
      cache = _empty(self._config, per_device, self._max_slots)(np.zeros(self._devices))
    else:
      cache = self._maybe_compact(state, np.asarray(active_B, bool)) if self._compact else state
    rows_DxR = self._rows_DxR
    held_DxR = np.maximum(rows_DxR, 0)
    present_DxR = rows_DxR >= 0
    tokens_DxRxC = np.where(present_DxR[..., None], chunk_BxC[held_DxR], 0).astype(chunk_BxC.dtype)
    mask_DxRxC = present_DxR[..., None] & np.asarray(chunk_mask_BxC, bool)[held_DxR]
    prefix = prefix_bucket(min(self._used + c + n, self._max_slots), self._max_slots)
    turn = _compiled(self._config, self._sampling, prefix)
    reply, reply_mask, cache = turn(self._params, tokens_DxRxC, mask_DxRxC, self._keys(), cache)
    self._turn += 1
    self._used += c + n
    reply_DxRxN, reply_mask_DxRxN = jax.device_get((reply, reply_mask))
    reply_BxN = np.full((b, n), self._sampling.pad_id, reply_DxRxN.dtype)
    reply_mask_BxN = np.zeros((b, n), bool)
    reply_BxN[rows_DxR[present_DxR]] = reply_DxRxN[present_DxR]
    reply_mask_BxN[rows_DxR[present_DxR]] = reply_mask_DxRxN[present_DxR]
    return reply_BxN, reply_mask_BxN, cache
