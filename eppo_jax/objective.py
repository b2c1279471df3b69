"""GRPO advantages and the EPPO loss: a PPO-clip surrogate with task-wise clipping bounds.

Per trained token t of a sequence of task k, with r = exp(logp - old_logp):

    L_t = max(-A * r, -A * clip(r, 1 - eps_low[k], 1 + eps_high[k]))      (PPO-clip)
    L_t = min(L_t, -A * c)                      if A < 0 and dual-clip c is set
        + kl_coef * KL_t(pi || pi_ref) - entropy_coef * H_t

then aggregated over tokens (see `_aggregate`). With every eps[k] equal this is exactly the
GRPO/DAPO loss; EPPO only changes where the bounds come from (eppo_jax.pacing).

Multi-device convention (pmap over `axis_name`): every normaliser (token count, sequence
count) is psum-ed, and the returned loss on each device is N_devices * (local share of the
global loss). Hence `lax.pmean(loss)` is the global loss and **the trainer must `lax.pmean`
the gradients** to get the gradient of the global loss: identical to 1 device on the same
global batch. Metrics are already global (identical on every device).

Micro-batches (gradient accumulation) follow the same idea along time: given the whole batch's
normalisers (`loss_totals`) and its Clip-Cov / KL-Cov token choice (`covariance_tokens`), every
number `eppo_loss` returns for a part of the batch is that part's additive share, so the sums over
the parts are the whole batch's loss, gradient and metrics.
"""

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from eppo_jax.pacing import PacingConfig

# ----------------------------------------------------------------------------- advantages


def _sum_over_devices(x, axis_name: Optional[str]):
  return x if axis_name is None else lax.psum(x, axis_name)


def _segment_moments(x_B, seg_B, num_segments: int, axis_name: Optional[str], valid_B=None):
  """(count, mean, unbiased variance, all-equal flag) per segment of the valid entries, over all
  devices; invalid entries (`valid_B` False) count nowhere and may hold any value, even NaN."""
  valid_B = jnp.ones(x_B.shape, bool) if valid_B is None else valid_B
  x_B = jnp.where(valid_B, x_B, 0.0)  # NaN * 0 is NaN: invalid values must not reach a sum.
  count_S = jax.ops.segment_sum(valid_B.astype(x_B.dtype), seg_B, num_segments)
  sum_S = jax.ops.segment_sum(x_B, seg_B, num_segments)
  count_S, sum_S = _sum_over_devices((count_S, sum_S), axis_name)
  mean_S = sum_S / jnp.maximum(count_S, 1.0)
  dev_B = jnp.where(valid_B, x_B - jnp.take(mean_S, seg_B, mode="clip"), 0.0)
  sq_S = _sum_over_devices(jax.ops.segment_sum(dev_B**2, seg_B, num_segments), axis_name)
  var_S = sq_S / jnp.maximum(count_S - 1.0, 1.0)  # ddof=1, as GRPO's torch.std
  # Equality is decided from max == min, not from var == 0: the rounding of mean = sum / n
  # can leave a tiny nonzero deviation that (dev / (std + eps)) would blow up to O(1).
  max_S = jax.ops.segment_max(jnp.where(valid_B, x_B, -jnp.inf), seg_B, num_segments)
  min_S = jax.ops.segment_min(jnp.where(valid_B, x_B, jnp.inf), seg_B, num_segments)
  if axis_name is not None:
    max_S, min_S = lax.pmax(max_S, axis_name), lax.pmin(min_S, axis_name)
  return count_S, mean_S, var_S, max_S == min_S


def _grpo(r_B, mean_B, std_B, n_B, eps):
  return (r_B - mean_B) / (std_B + eps)


def _drgrpo(r_B, mean_B, std_B, n_B, eps):
  # Dr. GRPO drops the std division: it up-weights groups of low reward variance (too easy
  # or too hard prompts) and biases the gradient.
  del std_B, eps
  return r_B - mean_B


def _rloo(r_B, mean_B, std_B, n_B, eps):
  # Leave-one-out baseline: r - mean(others) = n / (n - 1) * (r - mean(all)).
  del std_B, eps
  return (r_B - mean_B) * n_B / jnp.maximum(n_B - 1.0, 1.0)


# name -> fn(rewards_B, group_mean_B, std_B, group_size_B, eps) -> advantages_B
ADVANTAGE_ESTIMATORS: dict[str, Callable] = {"grpo": _grpo, "drgrpo": _drgrpo, "rloo": _rloo}


def grpo_advantages(rewards_B: jax.Array,
                    group_ids_B: jax.Array,
                    num_groups: int,
                    *,
                    estimator: str = "grpo",
                    task_ids: Optional[jax.Array] = None,
                    num_tasks: Optional[int] = None,
                    per_task_std: bool = False,
                    eps: float = 1e-6,
                    axis_name: Optional[str] = None,
                    valid_B: Optional[jax.Array] = None) -> jax.Array:
  """Group-relative advantages [B]; singleton and all-equal groups get exactly 0.

  Only valid episodes enter the statistics: `valid_B` (default all) and a finite reward. A failed
  episode (reward NaN by the trainer's convention) or a non-finite reward gets advantage 0, and
  its group's mean and std come from its healthy members; a group with fewer than two healthy
  members gets 0 everywhere.

  `per_task_std` divides by the std of the task's rewards (all its groups) instead of the
  group's, so that tasks with very different reward scales get comparable advantages; it
  only changes estimators that divide by a std. With `axis_name`, group statistics are
  reduced over devices, so group (and task) ids must be global, not per device.
  """
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ValueError(f"estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {estimator!r}")
  r_B = rewards_B.astype(jnp.promote_types(rewards_B.dtype, jnp.float32))
  ok_B = jnp.isfinite(r_B) if valid_B is None else jnp.isfinite(r_B) & valid_B
  r_B = jnp.where(ok_B, r_B, 0.0)
  count_G, mean_G, var_G, equal_G = _segment_moments(r_B, group_ids_B, num_groups, axis_name,
                                                     ok_B)
  n_B = jnp.take(count_G, group_ids_B, mode="clip")
  std_B = jnp.sqrt(jnp.take(var_G, group_ids_B, mode="clip"))
  if per_task_std:
    if task_ids is None or num_tasks is None:
      raise ValueError("per_task_std needs task_ids and num_tasks")
    _, _, var_K, _ = _segment_moments(r_B, task_ids, num_tasks, axis_name, ok_B)
    std_B = jnp.sqrt(jnp.take(var_K, task_ids, mode="clip"))
  adv_B = ADVANTAGE_ESTIMATORS[estimator](r_B, jnp.take(mean_G, group_ids_B, mode="clip"),
                                          std_B, n_B, eps)
  # A lone episode or a group that all scored the same carries no relative signal.
  in_range_B = (group_ids_B >= 0) & (group_ids_B < num_groups)
  degenerate_B = (n_B < 2) | jnp.take(equal_G, group_ids_B, mode="clip") | ~in_range_B | ~ok_B
  return jnp.where(degenerate_B, 0.0, adv_B)


# ----------------------------------------------------------------------------- loss config

KL_ESTIMATORS = ("k1", "k2", "k3")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo_clip", "clip_cov", "kl_cov")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Constants of the policy loss; frozen and hashable so it can be a static jit argument."""
  # Surrogate: "ppo_clip" (GRPO/DAPO/EPPO), or the covariance-based entropy controls of
  # Cui et al. 2025: "clip_cov" (detach the gradient of a few high-covariance tokens) and
  # "kl_cov" (unclipped surrogate plus |logp - old| on the top-covariance tokens).
  policy_loss: str = "ppo_clip"
  # Dual-clip constant c > 1 for A < 0 (caps the loss of very off-policy negative tokens at
  # -A * c); None disables it.
  dual_clip_c: Optional[float] = None
  # Weight of the KL to the reference policy; 0 skips it (and ref logprobs are not needed).
  kl_coef: float = 0.0
  # Per-token KL estimator: "k1" (logp - ref), "k2" (0.5 (logp - ref)^2) or "k3" (alias
  # "low_var_kl": exp(ref - logp) - (ref - logp) - 1, unbiased and always >= 0).
  kl_estimator: str = "k3"
  # k3's input log-ratio and output are clamped (to +-20 and +-kl_clamp) against overflow.
  kl_clamp: float = 10.0
  # Weight of the entropy bonus (subtracted from the loss); 0 skips it.
  entropy_coef: float = 0.0
  # Token aggregation: "token-mean" (every token of the global batch weighs the same),
  # "seq-mean-token-mean" (every sequence weighs the same) or "seq-mean-token-sum-norm"
  # (Dr. GRPO: per-sequence token sum / a constant length, mean over sequences).
  agg: str = "token-mean"
  # The constant length of "seq-mean-token-sum-norm"; None uses the padded length T.
  seq_norm_len: Optional[int] = None
  # |logp - old| is clamped before exp so a stale token cannot overflow the ratio.
  log_ratio_clamp: float = 20.0
  # Clip-Cov: fraction of trained tokens (global) whose gradient is detached, chosen among
  # unclipped tokens with covariance in (clip_cov_lb, clip_cov_ub), at random ("random",
  # as published; needs `rng`) or by largest covariance ("top", deterministic).
  clip_cov_ratio: float = 2e-4
  clip_cov_lb: float = 1.0
  clip_cov_ub: float = 5.0
  clip_cov_select: str = "random"
  # KL-Cov: fraction of trained tokens (global, largest covariance) penalised by
  # kl_cov_coef * |logp - old|.
  kl_cov_ratio: float = 2e-3
  kl_cov_coef: float = 1.0

  def __post_init__(self):
    if self.kl_estimator == "low_var_kl":  # the name verl uses for k3
      object.__setattr__(self, "kl_estimator", "k3")
    for name, value, allowed in (("policy_loss", self.policy_loss, POLICY_LOSSES),
                                 ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                                 ("agg", self.agg, AGG_MODES),
                                 ("clip_cov_select", self.clip_cov_select, ("random", "top"))):
      if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
      raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")


def kl_penalty(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array, estimator: str = "k3",
               clamp: float = 10.0) -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs: [B, T]."""
  diff_BxT = logprobs_BxT - ref_logprobs_BxT
  if estimator == "k1":
    return diff_BxT
  if estimator == "k2":
    return 0.5 * diff_BxT**2
  if estimator in ("k3", "low_var_kl"):
    log_ratio_BxT = jnp.clip(-diff_BxT, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio_BxT) - log_ratio_BxT - 1.0, -clamp, clamp)
  raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


# ----------------------------------------------------------------------------- loss


class LossTotals(NamedTuple):
  """The loss normalisers of a whole batch, for scoring a part of it (a micro-batch)."""
  token_count_K: jax.Array  # [K] float32: loss tokens per task.
  tokens: jax.Array  # [] float32: loss tokens.
  sequences: jax.Array  # [] float32: rows with at least one loss token.


def loss_totals(loss_mask_BxT, task_ids_B, num_tasks: int,
                axis_name: Optional[str] = None) -> LossTotals:
  """The normalisers of `eppo_loss` over this batch (and every device): its `totals` argument."""
  count_B = jnp.sum(loss_mask_BxT > 0, axis=1).astype(jnp.float32)
  sums = (jax.ops.segment_sum(count_B, task_ids_B, num_tasks), jnp.sum(count_B),
          jnp.sum(count_B > 0, dtype=jnp.float32))
  return LossTotals(*_sum_over_devices(sums, axis_name))


def _aggregate(tok_BxT, mask_BxT, cfg: LossConfig, axis_name: Optional[str],
               totals: Optional[LossTotals] = None):
  """Reduce per-token losses to this device's share of the global loss (see module doc)."""
  if cfg.agg == "token-mean":
    num = jnp.sum(tok_BxT * mask_BxT)
    den = (_sum_over_devices(jnp.sum(mask_BxT), axis_name) if totals is None
           else totals.tokens)
  else:
    count_B = jnp.sum(mask_BxT, axis=1)
    sum_B = jnp.sum(tok_BxT * mask_BxT, axis=1)
    if cfg.agg == "seq-mean-token-mean":
      seq_B = sum_B / jnp.maximum(count_B, 1.0)
    else:
      seq_B = sum_B / float(cfg.seq_norm_len or tok_BxT.shape[1])
    # Empty rows (padding, zero-length responses) are not sequences: they would dilute the mean.
    nonempty_B = count_B > 0
    num = jnp.sum(jnp.where(nonempty_B, seq_B, 0.0))
    den = (_sum_over_devices(jnp.sum(nonempty_B.astype(tok_BxT.dtype)), axis_name)
           if totals is None else totals.sequences)
  loss = num / jnp.maximum(den, 1.0)
  if axis_name is not None:
    loss = loss * lax.psum(1, axis_name)  # the device count: pmean over devices = global loss
  return loss


def _select_lowest(priority_BxT, eligible_BxT, num, axis_name: Optional[str]):
  """Mask of the `num` eligible tokens (over all devices) with the lowest priority."""
  # A dynamic count cannot feed lax.top_k, so sort everything and read the num-th value:
  # static shapes, and the same global choice as on one device. Ties at the threshold are
  # all selected.
  p_BxT = jnp.where(eligible_BxT, priority_BxT, jnp.inf)
  flat = p_BxT.reshape(-1)
  if axis_name is not None:
    flat = lax.all_gather(flat, axis_name).reshape(-1)
  kth = jnp.sort(flat)[jnp.clip(num - 1, 0, flat.shape[0] - 1)]
  return eligible_BxT & (p_BxT <= kth) & (num > 0)


def _covariance_tokens(logp_BxT, adv_BxT, mask_BxT, pg_clipped_BxT, cfg: LossConfig, rng,
                       axis_name: Optional[str]):
  """Tokens picked by Clip-Cov or KL-Cov (Cui et al. 2025), chosen over the global batch."""
  maskf_BxT = mask_BxT.astype(logp_BxT.dtype)
  logp_BxT = lax.stop_gradient(logp_BxT)
  n_valid, sum_adv, sum_logp = _sum_over_devices(
      (jnp.sum(maskf_BxT), jnp.sum(adv_BxT * maskf_BxT), jnp.sum(logp_BxT * maskf_BxT)),
      axis_name)
  denom = jnp.maximum(n_valid, 1.0)
  # Centred product of logprob and advantage: its batch mean is the covariance that drives
  # the entropy change of a softmax policy under policy gradient.
  cov_BxT = (logp_BxT - sum_logp / denom) * (adv_BxT - sum_adv / denom)
  if cfg.policy_loss == "clip_cov":
    fraction = cfg.clip_cov_ratio
    eligible_BxT = (mask_BxT & ~pg_clipped_BxT & (cov_BxT > cfg.clip_cov_lb)
                    & (cov_BxT < cfg.clip_cov_ub))
    if cfg.clip_cov_select == "random":
      if rng is None:
        raise ValueError("clip_cov with clip_cov_select='random' needs an rng key")
      if axis_name is not None:  # different draws on each device
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
      priority_BxT = jax.random.uniform(rng, cov_BxT.shape, cov_BxT.dtype)
    else:
      priority_BxT = -cov_BxT
  else:  # kl_cov: the largest covariances among all trained tokens
    fraction = cfg.kl_cov_ratio
    eligible_BxT = mask_BxT
    priority_BxT = -cov_BxT
  # max(1, floor(fraction * N)) as in the reference implementation: at least one token.
  num = jnp.maximum(jnp.floor(fraction * n_valid), 1.0).astype(jnp.int32)
  return _select_lowest(priority_BxT, eligible_BxT, num, axis_name)


def _bounds_per_sequence(eps, task_ids_B):
  eps = jnp.asarray(eps)
  if eps.ndim == 0:  # one bound for every task (fixed-clip baselines)
    return jnp.broadcast_to(eps, task_ids_B.shape)
  return jnp.take(eps, task_ids_B, mode="clip")


class _Surrogate(NamedTuple):
  """The per-token pieces of the clipped surrogate, untrained positions zeroed."""
  dtype: jnp.dtype
  mask_BxT: jax.Array  # bool
  logp_BxT: jax.Array
  old_BxT: jax.Array
  adv_BxT: jax.Array
  eps_low_Bx1: jax.Array
  eps_high_Bx1: jax.Array
  ratio_BxT: jax.Array
  unclipped_BxT: jax.Array  # -A r
  clipped_BxT: jax.Array  # -A clip(r, 1 - eps_low, 1 + eps_high)


def _surrogate(logprobs_BxT, old_logprobs_BxT, advantages_B, loss_mask_BxT, task_ids_B, eps_low_K,
               eps_high_K, cfg: LossConfig) -> _Surrogate:
  """The ratio and both sides of the clip for each token, with each sequence's task bounds."""
  dtype = jnp.promote_types(logprobs_BxT.dtype, jnp.float32)
  mask_BxT = loss_mask_BxT > 0
  # Untrained positions are zeroed first: garbage there (e.g. -inf padding logprobs) must
  # not turn into NaN, in the loss or in its gradient.
  logp_BxT = jnp.where(mask_BxT, logprobs_BxT.astype(dtype), 0.0)
  old_BxT = lax.stop_gradient(jnp.where(mask_BxT, old_logprobs_BxT.astype(dtype), 0.0))
  adv_BxT = jnp.asarray(advantages_B, dtype)
  adv_BxT = lax.stop_gradient(adv_BxT[:, None] if adv_BxT.ndim == 1 else adv_BxT)
  adv_BxT = jnp.where(mask_BxT, adv_BxT, 0.0)
  eps_low_Bx1 = _bounds_per_sequence(eps_low_K, task_ids_B).astype(dtype)[:, None]
  eps_high_Bx1 = _bounds_per_sequence(eps_high_K, task_ids_B).astype(dtype)[:, None]
  log_ratio_BxT = jnp.clip(logp_BxT - old_BxT, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  unclipped_BxT = -adv_BxT * ratio_BxT
  clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1.0 - eps_low_Bx1, 1.0 + eps_high_Bx1)
  return _Surrogate(dtype, mask_BxT, logp_BxT, old_BxT, adv_BxT, eps_low_Bx1, eps_high_Bx1,
                    ratio_BxT, unclipped_BxT, clipped_BxT)


def _selected(t: _Surrogate, cfg: LossConfig, rng, axis_name: Optional[str]):
  return _covariance_tokens(t.logp_BxT, t.adv_BxT, t.mask_BxT, t.clipped_BxT > t.unclipped_BxT,
                            cfg, rng, axis_name)


def covariance_tokens(logprobs_BxT, old_logprobs_BxT, advantages_B, loss_mask_BxT, task_ids_B,
                      eps_low_K, eps_high_K, *, cfg: LossConfig, axis_name: Optional[str] = None,
                      rng: Optional[jax.Array] = None) -> jax.Array:
  """[B, T] bool: the tokens Clip-Cov / KL-Cov (`cfg.policy_loss`) picks over this batch.

  The choice `eppo_loss` makes itself; made once over a whole batch and passed to `eppo_loss` of
  each of its parts (`selected_BxT`), it stays the whole batch's (gradient accumulation).
  """
  t = _surrogate(lax.stop_gradient(logprobs_BxT), old_logprobs_BxT, advantages_B, loss_mask_BxT,
                 task_ids_B, eps_low_K, eps_high_K, cfg)
  return _selected(t, cfg, rng, axis_name)


def _regularised(pg_BxT, logp_BxT, mask_BxT, ref_logprobs_BxT, token_entropy_BxT,
                 cfg: LossConfig):
  """(per-token loss with the KL and entropy terms, KL [B,T] or None, entropy [B,T] or None)."""
  dtype, tok_loss_BxT, kl_BxT, ent_BxT = pg_BxT.dtype, pg_BxT, None, None
  if cfg.kl_coef != 0.0:
    if ref_logprobs_BxT is None:
      raise ValueError("kl_coef != 0 needs ref_logprobs_BxT")
    ref_BxT = lax.stop_gradient(jnp.where(mask_BxT, ref_logprobs_BxT.astype(dtype), 0.0))
    kl_BxT = kl_penalty(logp_BxT, ref_BxT, cfg.kl_estimator, cfg.kl_clamp)
    tok_loss_BxT = tok_loss_BxT + cfg.kl_coef * kl_BxT
  if token_entropy_BxT is not None:
    ent_BxT = jnp.where(mask_BxT, token_entropy_BxT.astype(dtype), 0.0)
  if cfg.entropy_coef != 0.0:
    if ent_BxT is None:
      raise ValueError("entropy_coef != 0 needs token_entropy_BxT")
    tok_loss_BxT = tok_loss_BxT - cfg.entropy_coef * ent_BxT
  return tok_loss_BxT, kl_BxT, ent_BxT


def _token_means(per_token: dict, maskf_BxT, task_ids_B, num_tasks: int,
                 axis_name: Optional[str], totals=None) -> dict[str, jax.Array]:
  """Token-weighted means of each [B,T] metric over the loss tokens of every device, per task
  (`<name>_K`) and global (`<name>`), plus the token counts. With `totals` (a part of a batch),
  the means divide by the whole batch's counts: this part's share of them."""
  names = list(per_token)
  stacked_MxB = jnp.stack([jnp.sum(lax.stop_gradient(per_token[n]) * maskf_BxT, axis=1)
                           for n in names] + [jnp.sum(maskf_BxT, axis=1)])
  sums_MxK = jax.vmap(lambda x_B: jax.ops.segment_sum(x_B, task_ids_B, num_tasks))(stacked_MxB)
  sums_MxK, sums_M = _sum_over_devices((sums_MxK, stacked_MxB.sum(axis=1)), axis_name)
  count_K, count = sums_MxK[-1], sums_M[-1]
  metrics = {"token_count_K": count_K.astype(jnp.int32), "token_count": count.astype(jnp.int32)}
  if totals is not None:
    count_K, count = totals.token_count_K, totals.tokens
  for i, name in enumerate(names):
    metrics[f"{name}_K"] = sums_MxK[i] / jnp.maximum(count_K, 1.0)
    metrics[name] = sums_M[i] / jnp.maximum(count, 1.0)
  return metrics


def eppo_loss(logprobs_BxT: jax.Array,
              old_logprobs_BxT: jax.Array,
              advantages_B: jax.Array,
              loss_mask_BxT: jax.Array,
              task_ids_B: jax.Array,
              eps_low_K: jax.Array,
              eps_high_K: jax.Array,
              ref_logprobs_BxT: Optional[jax.Array] = None,
              token_entropy_BxT: Optional[jax.Array] = None,
              *,
              cfg: LossConfig = LossConfig(),
              axis_name: Optional[str] = None,
              num_tasks: Optional[int] = None,
              rng: Optional[jax.Array] = None,
              totals: Optional[LossTotals] = None,
              selected_BxT: Optional[jax.Array] = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Task-wise clipped policy loss and its (global) metrics: (scalar, dict).

  `advantages_B` may also be per token ([B, T]); `eps_low_K`/`eps_high_K` may be scalars
  (then pass `num_tasks`, which otherwise defaults to K). `rng` is only read by Clip-Cov's
  random selection. Under pmap the returned loss is N_devices times this device's share of
  the global loss: the trainer pmeans the gradients (see the module docstring).

  A part of a larger batch (a micro-batch) passes that batch's `totals` (`loss_totals`) and, for
  Clip-Cov / KL-Cov, its token choice `selected_BxT` (`covariance_tokens`; `rng` is then unused):
  the loss, its gradient and every metric (token counts included) are then this part's share,
  and their sums over the parts are the whole batch's.
  """
  t = _surrogate(logprobs_BxT, old_logprobs_BxT, advantages_B, loss_mask_BxT, task_ids_B,
                 eps_low_K, eps_high_K, cfg)
  dtype, mask_BxT, adv_BxT = t.dtype, t.mask_BxT, t.adv_BxT
  logp_BxT, old_BxT, ratio_BxT = t.logp_BxT, t.old_BxT, t.ratio_BxT
  eps_low_Bx1, eps_high_Bx1 = t.eps_low_Bx1, t.eps_high_Bx1
  maskf_BxT = mask_BxT.astype(dtype)

  # --- PPO-clip surrogate with each sequence's task bounds.
  pg_BxT = jnp.maximum(t.unclipped_BxT, t.clipped_BxT)
  if cfg.dual_clip_c is not None:
    # For A < 0 a huge ratio means a huge loss; dual-clip caps it at -A * c.
    pg_BxT = jnp.where(adv_BxT < 0, jnp.minimum(pg_BxT, -adv_BxT * cfg.dual_clip_c), pg_BxT)

  # --- Covariance-based entropy controls (baselines).
  if cfg.policy_loss == "ppo_clip":
    selected_BxT = jnp.zeros_like(mask_BxT)
  else:
    selected_BxT = (_selected(t, cfg, rng, axis_name) if selected_BxT is None
                    else selected_BxT.astype(bool) & mask_BxT)
    if cfg.policy_loss == "clip_cov":
      pg_BxT = jnp.where(selected_BxT, lax.stop_gradient(pg_BxT), pg_BxT)
    else:  # kl_cov replaces the ratio clip by the penalty on the selected tokens
      penalty_BxT = cfg.kl_cov_coef * jnp.abs(logp_BxT - old_BxT)
      pg_BxT = t.unclipped_BxT + jnp.where(selected_BxT, penalty_BxT, 0.0)

  # --- Regularisers.
  tok_loss_BxT, kl_BxT, ent_BxT = _regularised(pg_BxT, logp_BxT, mask_BxT, ref_logprobs_BxT,
                                               token_entropy_BxT, cfg)

  loss = _aggregate(tok_loss_BxT, maskf_BxT, cfg, axis_name, totals)

  # --- Metrics: per task and global, token-weighted over every device.
  if num_tasks is None:
    num_tasks = jnp.shape(eps_low_K)[0] if jnp.ndim(eps_low_K) == 1 else 1
  per_token = {
      "pg_loss": pg_BxT,
      "clip_frac_low": ((adv_BxT < 0) & (ratio_BxT < 1.0 - eps_low_Bx1)).astype(dtype),
      "clip_frac_high": ((adv_BxT > 0) & (ratio_BxT > 1.0 + eps_high_Bx1)).astype(dtype),
      "approx_kl": 0.5 * (logp_BxT - old_BxT)**2,  # k2 estimate of KL(pi_old || pi)
  }
  if cfg.dual_clip_c is not None:
    per_token["dual_clip_frac"] = ((adv_BxT < 0) & (ratio_BxT > cfg.dual_clip_c)).astype(dtype)
  if cfg.policy_loss != "ppo_clip":
    per_token["cov_selected_frac"] = selected_BxT.astype(dtype)
  if kl_BxT is not None:
    per_token["kl_ref"] = kl_BxT
  if ent_BxT is not None:
    per_token["entropy"] = ent_BxT
  metrics = _token_means(per_token, maskf_BxT, task_ids_B, num_tasks, axis_name, totals)
  global_loss = lax.stop_gradient(loss)
  metrics["loss"] = global_loss if axis_name is None else lax.pmean(global_loss, axis_name)
  return loss, metrics


# ----------------------------------------------------------------------------- presets

_METHOD_PRESETS = {
    # Pacing on, everything else the GRPO default.
    "eppo": ({}, {}),
    # Pacing off: one fixed symmetric clip; the only difference from "eppo" is alpha.
    "grpo": ({"alpha": 0.0, "eps0_low": 0.2, "eps0_high": 0.2}, {}),
    # Clip-higher (0.2 / 0.28) with token-mean aggregation.
    "dapo": ({"alpha": 0.0, "eps0_low": 0.2, "eps0_high": 0.28}, {"agg": "token-mean"}),
    # Reference recipe of Cui et al.: the ratio clip is opened to 1 on both sides (dual-clip
    # 10), and covariance clipping does the trust-region work.
    "clip_cov": ({"alpha": 0.0, "eps0_low": 1.0, "eps0_high": 1.0},
                 {"policy_loss": "clip_cov", "dual_clip_c": 10.0}),
    # KL-Cov's surrogate is unclipped; the bounds only feed the clip-fraction metrics.
    "kl_cov": ({"alpha": 0.0, "eps0_low": 0.2, "eps0_high": 0.2}, {"policy_loss": "kl_cov"}),
}


METHODS = tuple(_METHOD_PRESETS)


def method_configs(method: str, **overrides) -> tuple[PacingConfig, LossConfig]:
  """(PacingConfig, LossConfig) of a named method; keyword overrides go to the owning config."""
  if method not in _METHOD_PRESETS:
    raise ValueError(f"unknown method {method!r}; valid methods: {sorted(_METHOD_PRESETS)}")
  pacing_kw, loss_kw = (dict(d) for d in _METHOD_PRESETS[method])
  pacing_fields = {f.name for f in dataclasses.fields(PacingConfig)}
  loss_fields = {f.name for f in dataclasses.fields(LossConfig)}
  for key, value in overrides.items():
    if key in pacing_fields:
      pacing_kw[key] = value
    elif key in loss_fields:
      loss_kw[key] = value
    else:
      raise ValueError(f"unknown config field {key!r}; PacingConfig fields: "
                       f"{sorted(pacing_fields)}, LossConfig fields: {sorted(loss_fields)}")
  return PacingConfig(**pacing_kw), LossConfig(**loss_kw)
