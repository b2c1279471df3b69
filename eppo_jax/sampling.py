"""Jitted sampling: prefill a chunk into a slot KV cache, then decode in a `lax.while_loop`.

Shape letters: B batch, P prompt (chunk) length, N new tokens, T tokens, S cache slots, V vocab.

Logprob convention. The returned `logprobs` and `entropies` are those of the temperature-scaled,
untruncated policy `softmax(logits / temperature)`, i.e. *before* top-k / top-p truncation (the
GRPO / verl convention). Truncation only decides which token is drawn; the numbers describe the
policy that the loss recomputes teacher-forced with the same function
(`eppo_jax.logprobs.token_logprobs_and_entropy`, applied in chunks by the trainer), so old, new and
sampled log-probs are the same function of the parameters. Greedy decoding reports the same quantities (with the
configured temperature, default 1) for the argmax token.

Multi-turn. `rollout(..., cache=out.cache)` appends its chunk (observation + next turn header,
left-padded) after everything already in the cache and decodes from there: a conversation is never
re-encoded. Allocate the first cache with `max_len` slots for the whole episode: each call uses
`P + (decode steps actually taken)` slots and every decode step writes one slot for all rows. The
returned cache holds every generated token, stop tokens included. A row whose chunk is all padding
(an episode that already ended, a filler row) generates nothing in that call.

Static shapes. Left-pad prompts to a few bucket lengths (`left_pad`, `bucket`) and keep a few
`SamplingConfig`s: XLA then compiles one program per (bucket, config, batch, window), see
`compiled_programs`. The decode loop exits as soon as every row has stopped.

Cost. A call attends over a static window of the cache (its first slots) that covers the slots
written before it plus its own P + N (`window_bucket`: one of three sizes per cache), so the first
turn of a long episode does not pay for the whole episode's cache. On CPU the decode steps run the
layers over weights and cache slots split per layer once per call (`ModelConfig.unroll_layers`,
`transformer.split_cache`), so no step copies a layer's weights or keys.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from eppo_jax import logprobs
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import (Cache, forward_with_cache, init_cache, layer_params,
                                         merge_cache, split_cache, unrolls_layers,
                                         write_split_chunk)

Params = Any


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to draw tokens; hashable, so it is a static argument of the jitted rollout."""

  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0  # Nucleus: keep the smallest prefix of sorted tokens with mass >= top_p.
  top_k: int = 0  # 0 = off; ties at the k-th value are all kept.
  greedy: bool = False  # Argmax of the logits; temperature then only scales the reported numbers.
  stop_token_ids: tuple[int, ...] = ()  # A row stops after emitting any of these (it is kept).
  pad_id: int = 0  # Written after a row has stopped.

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got "
                       f"{self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@flax.struct.dataclass
class RolloutOutput:
  """Result of one `rollout` call; a pytree, so it crosses jit / pmap boundaries."""

  tokens: jax.Array  # [B,N] int32, pad_id after the stop token and for inactive rows.
  logprobs: jax.Array  # [B,N] float32, log pi(token) under softmax(logits / T); 0 where masked.
  entropies: jax.Array  # [B,N] float32, entropy of softmax(logits / T); 0 where masked.
  mask: jax.Array  # [B,N] bool, True up to and including the stop token.
  lengths: jax.Array  # [B] int32, number of generated tokens (= mask.sum(1)).
  cache: Cache  # The KV cache after the chunk and every generated token (stop tokens included).


# ----------------------------------------------------------------------------------------------
# Distribution helpers: the one formula of eppo_jax.logprobs, shared with the trainer, so sampled
# and recomputed numbers agree.


def truncate_logits(z_BxV, top_k: int = 0, top_p: float = 1.0):
  """Sets tokens outside top-k, then outside the top-p nucleus, to -inf (k first, as HF does)."""
  if top_k and top_k < z_BxV.shape[-1]:
    kth_B = jax.lax.top_k(z_BxV, top_k)[0][:, -1]
    z_BxV = jnp.where(z_BxV >= kth_B[:, None], z_BxV, -jnp.inf)
  if top_p < 1.0:
    sorted_BxV = jnp.sort(z_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # A sorted token is kept while the mass strictly before it is < top_p; the first always is.
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_BxV = mass_before_BxV < top_p
    threshold_B = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1)
    z_BxV = jnp.where(z_BxV >= threshold_B[:, None], z_BxV, -jnp.inf)
  return z_BxV


def sample_token(logits_BxV, rng_B, sampling: SamplingConfig):
  """Draws one token per row, row b from its own key `rng_B[b]` -> (token [B] int32, logprob [B],
  entropy [B]) per the convention."""
  z_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
  if sampling.greedy:
    token_B = jnp.argmax(logits_BxV, axis=-1)
  else:
    truncated_BxV = truncate_logits(z_BxV, sampling.top_k, sampling.top_p)
    token_B = jax.vmap(jax.random.categorical)(rng_B, truncated_BxV)
  token_B = token_B.astype(jnp.int32)
  logprob_Bx1, entropy_Bx1 = logprobs.token_logprobs_and_entropy(
      logits_BxV[:, None], token_B[:, None], sampling.temperature)
  return token_B, logprob_Bx1[:, 0], entropy_Bx1[:, 0]


# ----------------------------------------------------------------------------------------------
# Static-shape helpers (host side).


def bucket(n: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= n, so that XLA compiles one program per bucket rather than per length."""
  for b in sorted(buckets):
    if n <= b:
      return int(b)
  raise ValueError(f"length {n} exceeds the largest bucket {max(buckets)}; add a bigger bucket")


def left_pad(sequences: Sequence[Sequence[int]], buckets: Sequence[int], pad_id: int,
             min_len: int = 1):
  """Ragged token lists -> (tokens [B,P] int32, mask [B,P] bool), left-padded to a bucket length."""
  longest = max([len(s) for s in sequences] + [min_len])
  p = bucket(longest, buckets)
  tokens_BxP = np.full((len(sequences), p), pad_id, np.int32)
  mask_BxP = np.zeros((len(sequences), p), bool)
  for i, seq in enumerate(sequences):
    if len(seq):
      tokens_BxP[i, p - len(seq):] = np.asarray(seq, np.int32)
      mask_BxP[i, p - len(seq):] = True
  return tokens_BxP, mask_BxP


# ----------------------------------------------------------------------------------------------
# Cache bounds. `dynamic_update_slice` clamps an out-of-range start silently, which would overwrite
# the newest slots; so overflow is refused on the host when the index is concrete, and poisoned
# (NaN logits) when it is traced under an outer jit / pmap, where raising is impossible.


def _check_fits(cache: Cache, t: int, what: str) -> None:
  """Raises if writing `t` more slots overflows the cache; skipped when the index is traced."""
  slots = cache["mask"].shape[1]
  if t > slots:
    raise ValueError(f"{what}: {t} slots needed but the cache has only {slots}; allocate it with "
                     f"a larger max_len")
  index = cache["index"]
  if isinstance(index, jax.core.Tracer):
    return
  used = int(index)
  if used + t > slots:
    raise ValueError(f"{what}: the cache holds {used} of {slots} slots and {t} more are needed; "
                     f"allocate the first cache with max_len >= {used + t} for the whole episode")


def window_bucket(needed: int, slots: int) -> int:
  """Cache slots a call attends over: the smallest of S/4, S/2, S (rounded up to a multiple of 8)
  that holds `needed`. Few buckets on purpose: each (batch, window, chunk) shape is one more
  compiled program (seconds each on CPU), and every bucket is met in every batch of episodes."""
  if needed > slots:
    raise ValueError(f"{needed} slots needed but the cache has only {slots}")
  for i in range(2, 0, -1):
    size = min(slots, -(-slots // (2 ** i * 8)) * 8)
    if needed <= size:
      return size
  return slots


def _window(cache: Cache, needed: int, window: Optional[int]) -> int:
  """The static window of a call that writes `needed` more slots: as given, or bucketed from the
  cache's index when it is concrete, or the whole cache when it is traced."""
  slots = cache["mask"].shape[1]
  if window is not None:
    if not 0 < window <= slots:
      raise ValueError(f"window={window} must be in [1, {slots}] (the cache's slots)")
    return window
  index = cache["index"]
  if isinstance(index, jax.core.Tracer):
    return slots
  return window_bucket(int(index) + needed, slots)


# ----------------------------------------------------------------------------------------------
# Rollout.


def rollout_body(params, config: ModelConfig, prompt_tokens_BxP, prompt_mask_BxP, rng,
                 sampling: SamplingConfig, cache: Cache, window: Optional[int] = None,
                 row_ids_B=None):
  """`rollout` un-jitted and unchecked, on a given cache: for callers that jit it themselves.

  Attends over the first `window` cache slots (static; default all). A chunk that does not fit the
  window gets NaN logits rather than clamped cache writes (the index may be traced here).
  Row b draws from `rng` folded with `row_ids_B[b]` (default: b), so a row's tokens depend on its
  id, not on the batch around it: rows that keep their ids through a re-layout (another mesh, a
  compacted batch) draw the same tokens.
  """
  b = prompt_tokens_BxP.shape[0]
  row_ids_B = jnp.arange(b) if row_ids_B is None else row_ids_B
  rng_B = jax.vmap(jax.random.fold_in, (None, 0))(rng, row_ids_B)
  n = sampling.max_new_tokens
  window = window or cache["mask"].shape[1]
  prompt_mask_BxP = prompt_mask_BxP.astype(bool)
  fits = cache["index"] + prompt_tokens_BxP.shape[1] + n <= window
  forward = functools.partial(forward_with_cache, params, config, window=window)

  # Left padding puts every row's last valid token in the last column: only its logits are needed.
  last_logits_Bx1xV, cache = forward(prompt_tokens_BxP, prompt_mask_BxP, cache, head="last")
  unroll = unrolls_layers(config)
  l, _, k, _, h = cache["k"].shape
  zeros = jnp.zeros((l, b, k, 1, h), cache["k"].dtype)
  pending = (zeros, zeros, cache["index"])  # Unused by the rolled layer loop, which writes at once.
  full_cache = cache
  if unroll:
    # Split the stacked layer weights and the cache's first `window` slots once, outside the loop,
    # so decode steps read both in place. Each step's keys are then written at the start of the
    # next step (see `forward_with_cache`); the first such write puts zeros into the next free
    # slot, which the first step then fills.
    forward = functools.partial(forward_with_cache, layer_params(params, config), config,
                                window=window)
    cache = split_cache(cache, window)

  def decode_step(token_B, live_B, cache, pending):
    if unroll:
      return forward(token_B[:, None], live_B[:, None], write_split_chunk(cache, pending),
                     defer_write=True)
    return (*forward(token_B[:, None], live_B[:, None], cache), pending)
  logits_BxV = jnp.where(fits, last_logits_Bx1xV[:, 0], jnp.nan)
  # A row with nothing in its chunk has no next-token distribution: it is finished (e.g. an episode
  # that ended in an earlier turn, or a filler row), and generates nothing.
  done_B = ~prompt_mask_BxP.any(axis=1)
  stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)

  def cond(carry):
    step, done_B = carry[0], carry[2]
    return (step < n) & ~jnp.all(done_B)

  def body(carry):
    (step, logits_BxV, done_B, cache, pending, tokens_BxN, logprobs_BxN, entropies_BxN,
     mask_BxN) = carry
    step_rng_B = jax.vmap(jax.random.fold_in, (0, None))(rng_B, step)
    token_B, logprob_B, entropy_B = sample_token(logits_BxV, step_rng_B, sampling)
    live_B = ~done_B
    token_B = jnp.where(live_B, token_B, sampling.pad_id)
    tokens_BxN = tokens_BxN.at[:, step].set(token_B)
    logprobs_BxN = logprobs_BxN.at[:, step].set(jnp.where(live_B, logprob_B, 0.0))
    entropies_BxN = entropies_BxN.at[:, step].set(jnp.where(live_B, entropy_B, 0.0))
    mask_BxN = mask_BxN.at[:, step].set(live_B)
    stopped_B = jnp.isin(token_B, stop_ids) & live_B
    # Write the token just drawn (stop tokens included) so the cache holds the whole reply and a
    # later turn can continue it; finished rows write a masked pad slot. The logits of the last
    # step are unused, the price of a cache that is complete when the loop exits.
    logits_Bx1xV, cache, pending = decode_step(token_B, live_B, cache, pending)
    done_B = done_B | stopped_B | (step + 1 >= n)
    return (step + 1, logits_Bx1xV[:, 0], done_B, cache, pending, tokens_BxN, logprobs_BxN,
            entropies_BxN, mask_BxN)

  carry = (jnp.zeros((), jnp.int32), logits_BxV, done_B, cache, pending,
           jnp.full((b, n), sampling.pad_id, jnp.int32), jnp.zeros((b, n), jnp.float32),
           jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n), bool))
  _, _, _, cache, pending, tokens_BxN, logprobs_BxN, entropies_BxN, mask_BxN = (
      jax.lax.while_loop(cond, body, carry))
  if unroll:
    cache = merge_cache(full_cache, write_split_chunk(cache, pending))
  return RolloutOutput(tokens=tokens_BxN, logprobs=logprobs_BxN, entropies=entropies_BxN,
                       mask=mask_BxN, lengths=mask_BxN.sum(axis=1, dtype=jnp.int32), cache=cache)


def _rollout(params, config: ModelConfig, prompt_tokens_BxP, prompt_mask_BxP, rng,
             sampling: SamplingConfig, cache: Optional[Cache], max_len: Optional[int],
             window: int):
  if cache is None:
    # The barrier hides the all-zero cache from XLA, which would otherwise spend seconds
    # constant-folding the prefill's attention over the empty slots.
    cache = jax.lax.optimization_barrier(init_cache(
        config, prompt_tokens_BxP.shape[0], max_len or prompt_tokens_BxP.shape[1] +
        sampling.max_new_tokens))
  return rollout_body(params, config, prompt_tokens_BxP, prompt_mask_BxP, rng, sampling, cache,
                      window)


_rollout_jit = jax.jit(_rollout, static_argnames=("config", "sampling", "max_len", "window"),
                       donate_argnames=("cache",))


def rollout(params: Params, config: ModelConfig, prompt_tokens_BxP, prompt_mask_BxP, rng,
            sampling: SamplingConfig, cache: Optional[Cache] = None,
            max_len: Optional[int] = None, window: Optional[int] = None) -> RolloutOutput:
  """Prefills left-padded prompts (or appends them to `cache`) and samples up to N tokens per row.

  Rows stop on any stop id or after `max_new_tokens`; the loop exits once every row has stopped.
  Without `cache`, a cache of `max_len` slots (default P + N) is allocated; give the whole
  episode's length to continue the conversation later with `rollout(..., cache=out.cache)`.
  Attention reads only the first `window` cache slots (static), which must cover the slots used
  before the call plus P + N; by default a bucket of the cache size that does (`window_bucket`),
  or the whole cache when the index is traced (inside pmap: pass `window` from the host's count).
  A passed cache is donated. Pure and jitted (static `config`, `sampling`, `max_len`, `window`);
  callable inside `jax.pmap`, where each device samples its shard with its own `rng`.
  """
  p, n = prompt_tokens_BxP.shape[1], sampling.max_new_tokens
  if cache is None:
    if max_len is not None and max_len < p + n:
      raise ValueError(f"max_len={max_len} is smaller than prompt {p} + max_new_tokens {n}")
    slots = max_len or p + n
    window = window_bucket(p + n, slots) if window is None else window
    if not p + n <= window <= slots:
      raise ValueError(f"window={window} must be in [{p + n}, {slots}] for a new cache")
  else:
    if max_len is not None:
      raise ValueError("max_len only sizes a new cache; the passed cache keeps its own size")
    _check_fits(cache, p + n, "rollout")
    window = _window(cache, p + n, window)
  return _rollout_jit(params, config, prompt_tokens_BxP, prompt_mask_BxP, rng, sampling, cache,
                      max_len, window)


def compiled_programs() -> int:
  """Number of programs XLA has compiled for `rollout` in this process."""
  return _rollout_jit._cache_size()  # pylint: disable=protected-access
