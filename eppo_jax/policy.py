"""The model as an `agent.Policy`: one jitted rollout turn over the device mesh, the cache on device."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from eppo_jax import agent, hosts, interrupt, programs
from eppo_jax import mesh as meshlib
from eppo_jax.models.config import ModelConfig
from eppo_jax.sampling import SamplingConfig, window_bucket


class ModelPolicy:
  """Continues a batch of conversations by one assistant turn per call (see `agent.Policy`).

  `params` are global arrays on `mesh` (default: a data-parallel mesh over every device). Each
  host passes its own rows, padded with inactive (empty) rows to a multiple of its batch shards.
  Each episode draws from its own random stream, the turn's key folded with the episode's global
  id (`episode_offset` + its row on this host): its samples depend on neither the mesh, nor the
  number of hosts, nor which other episodes share its batch.

  On several hosts the turn is one program over all of them, so its shapes come from numbers
  every host holds: the chunk width (every host passes chunks of the same width) and
  `agent.Agreed` (the most rows and live rows on any host), which `agent.collect_episodes`
  agrees on; the policy itself takes no host collective. On one host `agreed` may be left out.

  Cost follows use. Each turn attends over a bucketed window of the cache that covers the slots
  written so far (counted here on the host, see `sampling.window_bucket`). A turn that would not
  fit the cache is refused (ValueError): the caller ends its episodes first. With `compact`, once
  the live episodes of every host fit a quarter of the batch (B/4, B/16, ..., while that is a
  multiple of the batch shards), each host's live rows of the cache are gathered into it, so
  later turns run on live rows only.
  Episodes are unchanged by compaction, greedy or sampled (up to float rounding of the logits).

  `prefill_chunk` > 0 caps the tokens one call prefills: a wider turn chunk first writes its
  leading columns into the cache in calls of at most that many, then samples after the rest.
  The prefill's activations (rows x chunk x MLP width) then stay within the cap; the replies are
  the same up to float rounding.
  """

  def __init__(self, params, config: ModelConfig, sampling: SamplingConfig, max_slots: int,
               rng: jax.Array, mesh: Optional[jax.sharding.Mesh] = None, compact: bool = True,
               prefill_chunk: int = 0, episode_offset: int = 0):
    self._mesh = mesh or meshlib.make_mesh(meshlib.DATA_ONLY)
    self._params = params
    self._config, self._sampling, self._max_slots = config, sampling, max_slots
    self._rng = rng
    self._compact = compact
    self._prefill_chunk = prefill_chunk
    self._episode_offset = episode_offset
    self._turn = 0
    self._shards = max(1, meshlib.batch_shards(self._mesh) // jax.process_count())
    self._rows_R = None  # Episode row (of this host) held by each cache row; -1 for an empty row.
    self._used = 0  # Cache slots written so far (every row's index is the same).

  def _programs(self, rows: int, window: int) -> programs.RolloutPrograms:
    run = programs.rollout_turn(self._config, self._sampling, self._mesh,
                                rows * jax.process_count(), self._max_slots, window)
    return programs.RolloutPrograms(*(interrupt.retry_if_stopping(getattr(run, field.name))
                                      for field in dataclasses.fields(run)))

  def _maybe_compact(self, cache, active_B, live: int):
    """Gathers the live rows into a smaller batch when the most live rows on any host (`live`)
    fit one; every host shrinks to the same size."""
    rows_R = self._rows_R
    live_R = np.zeros(len(rows_R), bool)
    live_R[rows_R >= 0] = active_B[rows_R[rows_R >= 0]]
    # Quarters of the batch (B, B/4, B/16, ...): each size is another set of compiled programs.
    smaller = len(rows_R)
    while smaller % (4 * self._shards) == 0 and smaller // 4 >= max(live, 1):
      smaller //= 4
    if smaller >= len(rows_R):
      return cache
    # Live rows first; dead rows fill the rest (their chunks are empty from now on).
    keep_R = np.concatenate([np.flatnonzero(live_R), np.flatnonzero(~live_R)])[:smaller]
    self._rows_R = np.where(live_R[keep_R], rows_R[keep_R], -1)
    # Each host names the global rows it keeps; together they are the smaller batch's rows.
    keep = hosts.put_rows(hosts.row_positions(len(rows_R), self._mesh)[keep_R].astype(np.int32),
                          self._mesh)
    with jax.set_mesh(self._mesh):
      return self._programs(len(rows_R), self._max_slots).compact(cache, keep)

  def __call__(self, chunk_BxC, chunk_mask_BxC, state, active_B,
               agreed: Optional[agent.Agreed] = None):
    b, width = chunk_BxC.shape
    n = self._sampling.max_new_tokens
    active_B = np.asarray(active_B, bool)
    if agreed is None:
      if jax.process_count() > 1:
        raise ValueError("ModelPolicy on several hosts needs `agreed`, the turn's sizes agreed by "
                         "every host (agent.collect_episodes passes them)")
      agreed = agent.Agreed(rows=b, live=int(active_B.sum()))
    used = 0 if state is None else self._used
    if used + width + n > self._max_slots:
      raise ValueError(f"a turn of {width} chunk + {n} reply slots after {used} written does not "
                       f"fit the {self._max_slots}-slot cache: end the episodes before it "
                       "(agent.collect_episodes truncates them)")
    if state is None:
      # Every host passes the same shape (a global array): hosts with fewer rows (an uneven
      # evaluation split) add empty rows.
      padded = -(-agreed.rows // self._shards) * self._shards
      self._rows_R = np.where(np.arange(padded) < b, np.arange(padded), -1)
      self._used = 0
      cache = None
    elif self._compact:
      cache = self._maybe_compact(state, active_B, agreed.live)
    else:
      cache = state
    rows_R = self._rows_R
    present_R = rows_R >= 0
    # Rows of no episode read an empty row appended to the chunk (a host may have no episodes).
    held_R = np.where(present_R, rows_R, b)
    empty = np.zeros((1, width), bool)
    tokens_RxC = np.concatenate([chunk_BxC, empty.astype(chunk_BxC.dtype)])[held_R]
    mask_RxC = np.concatenate([np.asarray(chunk_mask_BxC, bool), empty])[held_R]
    window = window_bucket(self._used + width + n, self._max_slots)
    run = self._programs(len(rows_R), window)
    key = jax.random.fold_in(self._rng, self._turn)
    # Rows of no episode draw from a stream no episode uses.
    ids_R = np.where(present_R, self._episode_offset + rows_R, -1).astype(np.int32)
    tokens, mask, ids = hosts.put_rows((tokens_RxC, mask_RxC, ids_R), self._mesh)
    # Leading columns beyond the prefill cap go in first, in pieces of at most the cap (static
    # widths: the cap, then what remains); the turn samples after the last `last` columns.
    last = width if not self._prefill_chunk else (width - 1) % self._prefill_chunk + 1
    with jax.set_mesh(self._mesh):  # Traced with the mesh in context: see `mesh.constrain_rows`.
      cache = run.empty_cache() if cache is None else cache
      if last < width:
        for start in range(0, width - last, self._prefill_chunk):
          end = start + self._prefill_chunk
          cache = run.prefill(self._params, tokens[:, start:end], mask[:, start:end], cache)
        tokens, mask = tokens[:, width - last:], mask[:, width - last:]
      reply, reply_mask, cache, scores = run.turn(self._params, tokens, mask, key, ids, cache)
    self._turn += 1
    self._used += width + n
    # Back to this host's episode order; rows of no episode are dropped.
    local = hosts.local_rows((reply, reply_mask) + tuple(scores), self._mesh)
    fills = (self._sampling.pad_id, False, 0.0, 0.0)
    reply_BxN, reply_mask_BxN, logprobs_BxN, entropies_BxN = (
        np.full((b, n), fill, x.dtype) for fill, x in zip(fills, local))
    for out, x in zip((reply_BxN, reply_mask_BxN, logprobs_BxN, entropies_BxN), local):
      out[rows_R[present_R]] = x[present_R]
    return reply_BxN, reply_mask_BxN, cache, (logprobs_BxN, entropies_BxN)
