"""The pure update steps: `train_step` (one EPPO update on a rollout batch) and `sft_step`.

Both are written for the global batch and run as `jax.jit` programs over the device mesh (see
`eppo_jax.programs`, which compiles them, and `eppo_jax.mesh`); XLA inserts the collectives that a
sharded batch needs, so 1 device and N devices compute the same update. The functions they are made
of (`eppo_jax.pacing`, `eppo_jax.objective`) also run per shard under `jax.pmap` / `shard_map` with
an `axis_name`; here they run with none.

One RL update, as `train_step` composes it:

    update_inputs       loss positions, advantages, the reference policy's scores (KL)
    old_policy_scores   the sampling policy's log-probs and entropies (the ratio's denominator)
    pace                task entropies -> smoothed pacing state -> per-task clip bounds
    ppo_updates         epochs x minibatches of `minibatch_update`: `minibatch_grads` (the
                        gradient of `minibatch_loss`, summed over `micro_batches` parts), then
                        `apply_update`, which skips a non-finite update
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from eppo_jax import logprobs, lora, objective, pacing
from eppo_jax.models import transformer
from eppo_jax.models.config import ModelConfig


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32, RL updates done
  trainable: Any  # params the optimizer owns (adapters, or the whole model)
  opt_state: Any
  pacing: pacing.PacingState


OLD_LOGPROBS = ("recompute", "sampler")
# Estimators whose advantages are computed on the host, per token, and enter the batch as
# "advantages" [B,T] aligned with "tokens" (`eppo_jax.gigpo`).
TOKEN_ADVANTAGES = ("gigpo",)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static description of one RL update (hashable: a jit static argument)."""

  model: ModelConfig
  pacing: pacing.PacingConfig
  loss: objective.LossConfig
  num_tasks: int
  num_groups: int  # Instances per step over all hosts (group ids are global).
  temperature: float = 1.0
  ppo_epochs: int = 1
  num_minibatches: int = 1
  # Parts each minibatch's gradient is accumulated over, one at a time: activation memory of one
  # part, the one optimizer update and its numbers of the whole minibatch (up to float rounding).
  # The old-policy and reference passes run in the same parts.
  micro_batches: int = 1
  advantage_estimator: str = "grpo"
  per_task_std: bool = False
  # The sharding of a [minibatches, rows, ...] stack, rows split like the batch
  # (`mesh.minibatch_sharding`). Without it XLA keeps each minibatch on the few devices that hold
  # its rows; with it every device works on every minibatch. None on one device.
  minibatch_sharding: Any = None
  # R, the loss positions scored per row: the LM head, log-probs and the loss run on [b, R] gathered
  # positions, not on all T - 1. None scores every position. A row with more loss tokens than R
  # keeps its first R; the rest are counted in metrics["loss_tokens_over_budget"] (the trainer
  # refuses such a batch before the step, see `check_loss_budget`).
  loss_tokens_per_row: Optional[int] = None
  # Old-policy log-probs (ratio denominator) and pacing entropies: "recompute" (teacher-forced with
  # the pre-update params, exact) or "sampler" (the rollout's own per-token numbers, batch keys
  # "logprobs" / "entropies" aligned with "tokens"; no old-policy pass). See docs/eppo.md.
  old_logprobs: str = "recompute"
  # P, the leading tokens that the `group_size` consecutive rows of each group share (their prompt,
  # found by `shared_prefix_length`): the update runs them once per group and the rest of each row
  # behind them (`transformer.prefix_hidden_states`); minibatches then hold whole groups and later
  # epochs shuffle groups, not rows. 0 runs every row whole.
  shared_prefix: int = 0
  group_size: int = 1

  def __post_init__(self):
    if self.old_logprobs not in OLD_LOGPROBS:
      raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
    if self.shared_prefix < 0 or self.group_size < 1:
      raise ValueError(f"shared_prefix {self.shared_prefix} must be >= 0 and group_size "
                       f"{self.group_size} >= 1")
    if self.micro_batches < 1:
      raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
    if self.loss_tokens_per_row is not None and self.loss_tokens_per_row < 1:
      raise ValueError(f"loss_tokens_per_row must be >= 1 or None, got {self.loss_tokens_per_row}")


def loss_positions(loss_mask_BxT, budget: int):
  """Indices of each row's first `budget` loss positions: (idx [B,R] int32, mask [B,R] bool)."""
  mask_BxT = loss_mask_BxT.astype(bool)
  idx_BxR = jax.vmap(lambda m: jnp.nonzero(m, size=budget, fill_value=0)[0])(mask_BxT)
  valid_BxR = jnp.arange(budget)[None] < mask_BxT.sum(axis=1, keepdims=True)
  return idx_BxR.astype(jnp.int32), valid_BxR


def shared_prefix_length(tokens_BxT, attention_mask_BxT, loss_mask_BxT, group_size: int,
                         multiple: int = 32) -> int:
  """Host: the `StepConfig.shared_prefix` this batch allows, rounded down to `multiple` (few
  distinct values, few compilations): the longest P such that the `group_size` consecutive rows of
  each group agree on their first P tokens and mask, and no row scores a position below P (position
  t scores token t + 1). 0 when the rows do not come in such groups."""
  tokens, mask = np.asarray(tokens_BxT), np.asarray(attention_mask_BxT).astype(bool)
  loss = np.asarray(loss_mask_BxT).astype(bool)
  b, t = tokens.shape
  if group_size < 2 or b % group_size:
    return 0
  tokens, mask = (x.reshape(b // group_size, group_size, t) for x in (tokens, mask))
  same_T = np.all((tokens == tokens[:, :1]) & (mask == mask[:, :1]), axis=(0, 1))
  limit = int(np.argmin(same_T)) if not same_T.all() else t
  scored = loss[:, 1:].any(axis=0)  # Position t scores token t + 1.
  if scored.any():
    limit = min(limit, int(np.argmax(scored)))
  limit = min(limit, t - 2)  # At least one position runs behind the prefix.
  return limit - limit % multiple


def check_loss_budget(loss_mask_BxT, budget: Optional[int]) -> None:
  """Host check: refuses a batch with a row of more loss tokens than the per-row budget R."""
  if budget is None:
    return
  most = int(np.asarray(loss_mask_BxT)[:, 1:].sum(axis=1).max(initial=0))
  if most > budget:
    raise ValueError(f"an episode has {most} loss tokens but StepConfig.loss_tokens_per_row is "
                     f"{budget}; raise it (at least max_turns x max_new_tokens)")


def scored_logprobs(params, model: ModelConfig, tokens_BxT, attention_mask_BxT, idx_BxR,
                    temperature: float, shared_prefix: int = 0, group_size: int = 1):
  """Teacher-forced log-prob and entropy at positions `idx` (None: all; t scores token t + 1).

  ([B,R], [B,R]) float32 of softmax(logits / temperature), the distribution the sampler draws from
  and reports. The LM head runs only at the gathered positions, in chunks (eppo_jax.logprobs).
  With `shared_prefix` P (see `StepConfig`), every position of `idx` is >= P.
  """
  # U = T - 1 - P positions are run: those after the shared prefix (all T - 1 when P = 0).
  tokens_BxT1, mask_BxT1 = tokens_BxT[:, :-1], attention_mask_BxT[:, :-1]
  target_BxU = tokens_BxT[:, 1 + shared_prefix:]
  if shared_prefix:
    hidden_BxUxD = transformer.prefix_hidden_states(params, model, tokens_BxT1, mask_BxT1,
                                                    shared_prefix, group_size)
    # A budget slot without a loss token holds index 0; its score is masked out.
    idx_BxR = None if idx_BxR is None else jnp.maximum(idx_BxR - shared_prefix, 0)
  else:
    hidden_BxUxD = transformer.hidden_states(params, model, tokens_BxT1, mask_BxT1)
  hidden_BxRxD, target_BxR = hidden_BxUxD, target_BxU
  if idx_BxR is not None:
    hidden_BxRxD = jnp.take_along_axis(hidden_BxUxD, idx_BxR[..., None], axis=1)
    target_BxR = jnp.take_along_axis(target_BxU, idx_BxR, axis=1)
  return logprobs.head_logprobs_and_entropy(hidden_BxRxD, transformer.head_kernel(params, model),
                                            target_BxR, temperature, model)


def sequence_logprobs(params, model: ModelConfig, tokens_BxT, attention_mask_BxT,
                      temperature: float):
  """Teacher-forced log-prob and entropy of each next token: ([B,T-1], [B,T-1]) float32."""
  return scored_logprobs(params, model, tokens_BxT, attention_mask_BxT, None, temperature)


# ----------------------------------------------------------------------------------------------
# The parts of one RL update.


def _minibatches(batch: dict, order_M: Optional[jax.Array], num: int, sharding=None) -> dict:
  """[b, ...] leaves -> [num, b / num, ...] in the order of `order_M` (None: as they are)."""
  def split(x):
    x = x if order_M is None else x[order_M]
    x = x.reshape((num, x.shape[0] // num) + x.shape[1:])
    return x if sharding is None else lax.with_sharding_constraint(x, sharding)
  return jax.tree_util.tree_map(split, batch)


def _epoch_order(key, b: int, group: int) -> jax.Array:
  """[b] a random order of the rows that keeps each group's `group` consecutive rows together."""
  groups = jax.random.permutation(key, b // group)
  return (groups[:, None] * group + jnp.arange(group)[None]).reshape(b)


def _finite(*trees) -> jax.Array:
  leaves = [x for t in trees for x in jax.tree_util.tree_leaves(t)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _abs_mean(advantages, loss_mask_BxR) -> jax.Array:
  """Mean |A| over the episodes ([b] advantages) or over the loss tokens ([b,R] advantages)."""
  if advantages.ndim == 1:
    return jnp.mean(jnp.abs(advantages))
  return jnp.sum(jnp.abs(advantages)) / jnp.maximum(jnp.sum(loss_mask_BxR), 1)


def _take(tree, i):
  return jax.tree_util.tree_map(lambda x: x[i], tree)


def _in_parts(fn, rows: dict, parts: int, cfg: StepConfig):
  """`fn` on `parts` consecutive slices of `rows` in turn (the activation memory of one slice), its
  [rows / parts, ...] outputs joined back to [rows, ...]; `fn(rows)` itself for one part."""
  if parts == 1:
    return fn(rows)
  b = rows["tokens"].shape[0]
  out = lax.map(fn, _minibatches(rows, None, parts, cfg.minibatch_sharding))
  return jax.tree_util.tree_map(lambda x: x.reshape((b,) + x.shape[2:]), out)


def _accumulate(fn, parts):
  """`fn` on each slice of `parts` (leading axis) in turn, `fn(part) = (summed, stacked)` ->
  (the sum of `summed` over the parts, the [parts, ...] stack of `stacked`).

  Floating-point sums are kept in float32 at least, then cast back to `fn`'s dtypes.
  """
  like = jax.eval_shape(fn, _take(parts, 0))[0]
  wide = lambda d: jnp.promote_types(d, jnp.float32) if jnp.issubdtype(d, jnp.floating) else d
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, wide(s.dtype)), like)

  def body(total, part):
    summed, stacked = fn(part)
    return jax.tree_util.tree_map(lambda t, x: t + x.astype(t.dtype), total, summed), stacked

  total, stacked = lax.scan(body, zeros, parts)
  return jax.tree_util.tree_map(lambda t, s: t.astype(s.dtype), total, like), stacked


def _score(params, mb: dict, cfg: StepConfig):
  """Log-probs and entropies ([b,R], [b,R]) of a minibatch's loss positions under `params`."""
  return scored_logprobs(params, cfg.model, mb["tokens"], mb["attention_mask"], mb["idx"],
                         cfg.temperature, cfg.shared_prefix, cfg.group_size)


def update_inputs(params, batch: dict, cfg: StepConfig) -> tuple[dict, jax.Array]:
  """(per-row inputs of the PPO updates, loss tokens beyond the row budget R).

  The rows carry their [b,R] loss positions `idx` and `loss_mask`, their `advantages`, and with a
  KL term the reference policy's log-probs `ref_logp`.
  """
  b, t = batch["tokens"].shape
  # Only positions that carry loss are scored: [b, R] gathered from [b, T - 1] (position t scores
  # token t + 1), a few percent of an agentic episode whose prompt and observations carry none.
  budget = min(cfg.loss_tokens_per_row or t - 1, t - 1)
  # An episode with a non-finite reward (how the trainer marks a failed one) carries no loss
  # token, so it enters neither the loss nor the task entropies.
  valid_B = jnp.isfinite(batch["rewards"])
  full_mask_BxT = batch["loss_mask"][:, 1:].astype(bool) & valid_B[:, None]
  idx_BxR, loss_mask_BxR = loss_positions(full_mask_BxT, budget)
  over_budget = jnp.sum(jnp.maximum(full_mask_BxT.sum(axis=1) - budget, 0))
  if cfg.advantage_estimator in TOKEN_ADVANTAGES:  # Per token: [b,R] at the scored positions.
    advantages = jnp.take_along_axis(batch["advantages"][:, 1:], idx_BxR, axis=1)
    advantages = jnp.where(loss_mask_BxR, advantages, 0.0)
  else:  # Per episode: [b].
    advantages = objective.grpo_advantages(
        batch["rewards"], batch["group_ids"], cfg.num_groups, estimator=cfg.advantage_estimator,
        task_ids=batch["task_ids"], num_tasks=cfg.num_tasks, per_task_std=cfg.per_task_std)
  data = {k: batch[k] for k in ("tokens", "attention_mask", "task_ids")}
  data.update(idx=idx_BxR, loss_mask=loss_mask_BxR, advantages=advantages)
  if cfg.loss.kl_coef:
    # The reference policy is the base model: the same params with the adapters left out.
    ref_params = transformer.layer_params(lora.base_params(params), cfg.model)  # Split once.
    in_order = _minibatches(data, None, cfg.num_minibatches, cfg.minibatch_sharding)
    ref_logp = lambda rows: _score(ref_params, rows, cfg)[0]
    data["ref_logp"] = lax.map(lambda mb: _in_parts(ref_logp, mb, cfg.micro_batches, cfg),
                               in_order).reshape(b, -1)
  return data, over_budget


def minibatch_loss(trainable, frozen, mb: dict, key, eps_low_K, eps_high_K, old_logp_BxR,
                   cfg: StepConfig, totals: Optional[objective.LossTotals] = None):
  """EPPO loss of one minibatch -> (loss, (metrics, log-probs [b,R], entropies [b,R])).

  With `totals` (and for Clip-Cov / KL-Cov `mb["selected"]`), `mb` is a micro-batch of the
  minibatch that they describe, and its loss and metrics are its share (`objective.eppo_loss`).
  """
  logp_BxR, ent_BxR = _score(lora.combine(trainable, frozen), mb, cfg)
  # None: the old policy is this pass (nothing updated yet), the ratio exactly 1.
  old = lax.stop_gradient(logp_BxR) if old_logp_BxR is None else old_logp_BxR
  # Dr. GRPO's constant length is the padded episode length, as if every position were scored.
  loss_cfg = dataclasses.replace(cfg.loss,
                                 seq_norm_len=cfg.loss.seq_norm_len or mb["tokens"].shape[1] - 1)
  loss, metrics = objective.eppo_loss(
      logp_BxR, old, mb["advantages"], mb["loss_mask"], mb["task_ids"], eps_low_K, eps_high_K,
      mb.get("ref_logp"), ent_BxR, cfg=loss_cfg, num_tasks=cfg.num_tasks, rng=key, totals=totals,
      selected_BxT=mb.get("selected"))
  return loss, (metrics, lax.stop_gradient(logp_BxR), lax.stop_gradient(ent_BxR))


def apply_update(carry, loss, metrics: dict, grads, tx: optax.GradientTransformation):
  """One optimizer update of (trainable, opt_state), skipped when the loss or a gradient is not
  finite (the host counts skips and stops the run after several in a row)."""
  trainable, opt_state = carry
  # A leafwise finiteness check rather than one on the gradient norm: on a mesh the update holds
  # collectives, and every device must take the same branch of the `cond`.
  ok = jnp.isfinite(loss) & _finite(grads)

  def step(operands):
    trainable, opt_state, grads = operands
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state

  # A branch, not a select of old and new: the skipped path holds no second copy of the params
  # and optimizer state, which matters for full fine-tuning.
  carry = lax.cond(ok, step, lambda operands: operands[:2], (trainable, opt_state, grads))
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads), skipped=1 - ok.astype(jnp.int32))
  return carry, metrics


def _covariance_choice(trainable, frozen, mb: dict, key, eps_low_K, eps_high_K, old_logp_BxR,
                       cfg: StepConfig):
  """Clip-Cov / KL-Cov's tokens [b,R] over the whole minibatch, from a forward pass run in
  `cfg.micro_batches` parts: the choice depends on every token's log-prob (before the gradient)."""
  params = transformer.layer_params(lora.combine(trainable, frozen), cfg.model)
  logp_BxR = _in_parts(lambda rows: _score(params, rows, cfg)[0], mb, cfg.micro_batches, cfg)
  old_BxR = logp_BxR if old_logp_BxR is None else old_logp_BxR  # None: ratio 1, as in the loss.
  return objective.covariance_tokens(logp_BxR, old_BxR, mb["advantages"], mb["loss_mask"],
                                     mb["task_ids"], eps_low_K, eps_high_K, cfg=cfg.loss, rng=key)


def minibatch_grads(trainable, frozen, mb: dict, key, eps_low_K, eps_high_K, old_logp_BxR,
                    cfg: StepConfig):
  """`minibatch_loss` and its gradient -> ((loss, (metrics, log-probs, entropies)), grads).

  With `cfg.micro_batches` > 1 the minibatch runs in that many parts, one at a time, each scored
  against the whole minibatch's normalisers (and Clip-Cov / KL-Cov token choice), and the parts'
  losses, metrics and gradients are summed: the whole minibatch's numbers up to float rounding,
  at the activation memory of one part.
  """
  grad_fn = jax.value_and_grad(minibatch_loss, has_aux=True)
  n, b = cfg.micro_batches, mb["tokens"].shape[0]
  if n == 1:
    return grad_fn(trainable, frozen, mb, key, eps_low_K, eps_high_K, old_logp_BxR, cfg)
  totals = objective.loss_totals(mb["loss_mask"], mb["task_ids"], cfg.num_tasks)
  if cfg.loss.policy_loss != "ppo_clip":
    mb = dict(mb, selected=_covariance_choice(trainable, frozen, mb, key, eps_low_K, eps_high_K,
                                              old_logp_BxR, cfg))
  if old_logp_BxR is not None:
    mb = dict(mb, old_logp=old_logp_BxR)

  def part(rows):
    (loss, (metrics, logp, ent)), grads = grad_fn(trainable, frozen, rows, key, eps_low_K,
                                                  eps_high_K, rows.get("old_logp"), cfg, totals)
    return (loss, metrics, grads), (logp, ent)

  (loss, metrics, grads), (logp, ent) = _accumulate(
      part, _minibatches(mb, None, n, cfg.minibatch_sharding))
  return (loss, (metrics, logp.reshape(b, -1), ent.reshape(b, -1))), grads


def minibatch_update(carry, frozen, mb: dict, key, eps_low_K, eps_high_K, cfg: StepConfig, tx):
  """`minibatch_grads` of one minibatch, then `apply_update` -> (carry, metrics)."""
  (loss, (metrics, _, _)), grads = minibatch_grads(carry[0], frozen, mb, key, eps_low_K,
                                                   eps_high_K, mb["old_logp"], cfg)
  return apply_update(carry, loss, metrics, grads, tx)


def old_policy_scores(state: TrainState, frozen, data: dict, batch: dict, key, cfg: StepConfig,
                      tx) -> tuple[jax.Array, jax.Array, Optional[tuple]]:
  """The sampling policy's log-probs and entropies at the loss positions ([b,R], [b,R]), and the
  first update's (carry, metrics) when its pass provided them (None otherwise).

  "sampler": the rollout's own numbers (aligned with tokens: token t + 1 is scored at position t).
  "recompute": teacher-forced with the pre-update params. The first minibatch of the first epoch is
  differentiated then, before pacing has produced this step's bounds: its ratio is exactly 1,
  strictly inside every [1 - eps_low, 1 + eps_high], so neither its gradient nor its metrics depend
  on the bounds (nor do the KL, the entropy bonus or Clip-Cov / KL-Cov's token choice), and its own
  pass (stop-gradient) is the old policy's. Only the other minibatches need a separate pass with the
  pre-update params, one micro-batch at a time to bound its activation memory.
  """
  b, m = batch["tokens"].shape[0], cfg.num_minibatches
  if cfg.old_logprobs == "sampler":
    if "logprobs" not in batch or "entropies" not in batch:
      raise ValueError('old_logprobs="sampler" needs batch["logprobs"] and batch["entropies"]')
    old_logp_BxR, entropy_BxR = (
        jnp.take_along_axis(batch[k][:, 1:].astype(jnp.float32), data["idx"], axis=1)
        for k in ("logprobs", "entropies"))
    return old_logp_BxR, entropy_BxR, None
  placeholder_K = jnp.ones((cfg.num_tasks,), jnp.float32)  # Any positive bounds: unused at r = 1.
  in_order = _minibatches(data, None, m, cfg.minibatch_sharding)
  (loss0, (metrics0, logp0, ent0)), grads0 = minibatch_grads(
      state.trainable, frozen, _take(in_order, 0), key, placeholder_K, placeholder_K, None, cfg)
  first = apply_update((state.trainable, state.opt_state), loss0, metrics0, grads0, tx)
  old_logp, entropy = logp0[None], ent0[None]
  if m > 1:
    rest = jax.tree_util.tree_map(lambda x: x[1:], in_order)
    old_params = transformer.layer_params(lora.combine(state.trainable, frozen), cfg.model)
    old_scores = lambda rows: _score(old_params, rows, cfg)
    old_rest, ent_rest = lax.map(lambda mb: _in_parts(old_scores, mb, cfg.micro_batches, cfg),
                                 rest)
    old_logp = jnp.concatenate([old_logp, old_rest])
    entropy = jnp.concatenate([entropy, ent_rest])
  return old_logp.reshape(b, -1), entropy.reshape(b, -1), first


def pacing_mask(batch: dict, data: dict, cfg: StepConfig) -> jax.Array:
  """[b,R] the scored positions whose entropy paces: every loss token, or with
  `pacing.entropy_tokens="action"` those that spell an action (`batch["action_mask"]` [B,T])."""
  if cfg.pacing.entropy_tokens == "all":
    return data["loss_mask"]
  action_BxR = jnp.take_along_axis(batch["action_mask"][:, 1:], data["idx"], axis=1)
  return data["loss_mask"] & action_BxR


def pace(state: pacing.PacingState, entropy_BxR, loss_mask_BxR, task_ids_B, cfg: StepConfig):
  """EPPO: task entropies of the sampling policy -> smoothed state -> per-task bounds.

  Returns (new pacing state, eps_low [K], eps_high [K], metrics). A batch whose task entropies are
  not finite leaves the pacing state as it was.
  """
  ent_K, cnt_K = pacing.task_entropy(entropy_BxR, loss_mask_BxR, task_ids_B, cfg.num_tasks)
  diagnostics = pacing.pacing_diagnostics(state, ent_K, cnt_K, cfg.pacing)
  healthy = jnp.all(jnp.isfinite(ent_K))
  new_state = pacing.update_pacing(state, ent_K, cnt_K, cfg.pacing)
  new_state = jax.tree_util.tree_map(lambda n, o: jnp.where(healthy, n, o), new_state, state)
  eps_low_K, eps_high_K = pacing.pacing_bounds(new_state, cfg.pacing)
  metrics = dict(
      entropy_K=ent_K, token_count_K=cnt_K, eps_low_K=eps_low_K, eps_high_K=eps_high_K,
      entropy_ema_K=new_state.ema_K, entropy_crossovers=diagnostics["entropy_crossovers"],
      entropy_spikes_K=diagnostics["entropy_spikes_K"].astype(jnp.int32),
      num_entropy_spikes=diagnostics["num_entropy_spikes"], nonfinite_entropy=1 - healthy)
  return new_state, eps_low_K, eps_high_K, metrics


def ppo_updates(carry, frozen, data: dict, rng_epochs, eps_low_K, eps_high_K, first,
                cfg: StepConfig, tx):
  """`cfg.ppo_epochs` passes of `cfg.num_minibatches` updates -> (carry, metrics per update).

  `first` (from `old_policy_scores`) is the first epoch's first update, already taken.
  """
  b, m = data["tokens"].shape[0], cfg.num_minibatches
  update = lambda carry, xs: minibatch_update(carry, frozen, *xs, eps_low_K, eps_high_K, cfg, tx)
  per_update = []
  for epoch in range(cfg.ppo_epochs):
    perm_key, loss_key = jax.random.split(rng_epochs[epoch])
    order = _epoch_order(perm_key, b, cfg.group_size if cfg.shared_prefix else 1) if epoch else None
    mbs = _minibatches(data, order, m, cfg.minibatch_sharding)
    keys = jax.random.split(loss_key, m)
    if epoch == 0 and first is not None:
      carry, metrics = first
      per_update.append(jax.tree_util.tree_map(lambda x: x[None], metrics))
      mbs, keys = jax.tree_util.tree_map(lambda x: x[1:], (mbs, keys))
      if m == 1:
        continue
    carry, metrics = lax.scan(update, carry, (mbs, keys))
    per_update.append(metrics)
  return carry, jax.tree_util.tree_map(lambda *x: jnp.concatenate(x), *per_update)


def train_step(state: TrainState, frozen, batch: dict, rng: jax.Array, *, cfg: StepConfig,
               tx: optax.GradientTransformation):
  """One RL update: old-policy scores, pacing, then PPO epochs x minibatches.

  `batch` (the global batch): tokens / attention_mask / loss_mask [B,T], task_ids / group_ids [B]
  int32, rewards [B] float32 (NaN or inf: the episode is left out); with
  `cfg.pacing.entropy_tokens == "action"` also action_mask [B,T] bool; with
  `cfg.old_logprobs == "sampler"` also logprobs / entropies [B,T] float32 (the sampler's number for
  each token). Returns (new state, metrics).
  """
  b, m, n = batch["tokens"].shape[0], cfg.num_minibatches, cfg.micro_batches
  if b % (m * n):
    raise ValueError(f"batch {b} is not divisible by {m} minibatches x {n} micro-batches")
  if cfg.shared_prefix and (b // (m * n)) % cfg.group_size:
    raise ValueError(f"a shared prefix needs whole groups of {cfg.group_size} rows in each "
                     f"minibatch (or micro-batch) of {b // (m * n)}")
  data, over_budget = update_inputs(lora.combine(state.trainable, frozen), batch, cfg)
  rng_epochs = jax.random.split(rng, cfg.ppo_epochs)
  first_key = jax.random.split(jax.random.split(rng_epochs[0])[1], m)[0]  # The first update's.
  data["old_logp"], entropy_BxR, first = old_policy_scores(state, frozen, data, batch, first_key,
                                                           cfg, tx)
  new_pacing, eps_low_K, eps_high_K, pacing_metrics = pace(
      state.pacing, entropy_BxR, pacing_mask(batch, data, cfg), batch["task_ids"], cfg)
  (trainable, opt_state), per_update = ppo_updates(
      (state.trainable, state.opt_state), frozen, data, rng_epochs, eps_low_K, eps_high_K, first,
      cfg, tx)
  metrics = {k: (v.sum(0) if k == "skipped" else v.mean(0)) for k, v in per_update.items()}
  metrics.update(pacing_metrics, loss_tokens_over_budget=over_budget.astype(jnp.int32),
                 advantage_abs_mean=_abs_mean(data["advantages"], data["loss_mask"]))
  new_state = TrainState(step=state.step + 1, trainable=trainable, opt_state=opt_state,
                         pacing=new_pacing)
  return new_state, metrics


# ----------------------------------------------------------------------------------------------
# Supervised warm start.


def sft_loss(params, model: ModelConfig, batch: dict, total_tokens=None):
  """Token-mean NLL of the loss-masked (assistant) tokens of the batch; with `total_tokens`, the
  batch's share of the mean over a larger batch that holds that many loss tokens."""
  logp_BxT, _ = sequence_logprobs(params, model, batch["tokens"], batch["attention_mask"], 1.0)
  mask_BxT = batch["loss_mask"][:, 1:].astype(jnp.float32)
  count = jnp.sum(mask_BxT) if total_tokens is None else total_tokens
  return jnp.sum(-logp_BxT * mask_BxT) / jnp.maximum(count, 1.0)


def sft_step(trainable, opt_state, frozen, batch: dict, *, model: ModelConfig,
             tx: optax.GradientTransformation, micro_batches: int = 1, minibatch_sharding=None):
  """One supervised update on expert demonstrations -> (trainable, opt_state, metrics).

  With `micro_batches` > 1 the gradient is summed over that many parts of the batch, run in turn
  (`minibatch_sharding` lays out their [parts, rows, ...] stack, see `StepConfig`).
  """
  def loss_and_grads(rows, total_tokens=None):
    return jax.value_and_grad(lambda t: sft_loss(lora.combine(t, frozen), model, rows,
                                                 total_tokens))(trainable)

  b = batch["tokens"].shape[0]
  if b % micro_batches:
    raise ValueError(f"SFT batch {b} is not divisible by {micro_batches} micro-batches")
  if micro_batches == 1:
    loss, grads = loss_and_grads(batch)
  else:
    total = jnp.sum(batch["loss_mask"][:, 1:].astype(jnp.float32))
    parts = _minibatches(batch, None, micro_batches, minibatch_sharding)
    (loss, grads), _ = _accumulate(lambda rows: (loss_and_grads(rows, total), ()), parts)
  updates, opt_state = tx.update(grads, opt_state, trainable)
  return (optax.apply_updates(trainable, updates), opt_state,
          {"sft_loss": loss, "sft_grad_norm": optax.tree.norm(grads)})
