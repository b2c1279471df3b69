"""The pure update steps: `train_step` (one EPPO update on a rollout batch) and `sft_step`.

The trainer runs both as `jax.jit` on the global batch over a device mesh (`axis_name=None`; see
`eppo_jax.mesh`), with the state donated. They also run per shard under `jax.pmap` / `shard_map`
with `axis_name="data"`: gradients of the trainable leaves (LoRA adapters, or everything for full
fine-tuning) are then `pmean`-ed, following the loss convention of `objective.eppo_loss` (each
device returns N_devices x its share), so both ways compute the same update on the same batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from eppo_jax import lora, objective, pacing
from eppo_jax.models import transformer
from eppo_jax.models.config import ModelConfig


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32, RL updates done
  trainable: Any  # params the optimizer owns (adapters, or the whole model)
  opt_state: Any
  pacing: pacing.PacingState


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static description of one RL update (hashable: a jit/pmap static argument)."""

  model: ModelConfig
  pacing: pacing.PacingConfig
  loss: objective.LossConfig
  num_tasks: int
  num_groups: int  # Instances per step over all devices (group ids are global).
  temperature: float = 1.0
  ppo_epochs: int = 1
  num_minibatches: int = 1
  advantage_estimator: str = "grpo"
  per_task_std: bool = False
  axis_name: Optional[str] = "data"
  # Under jit on a device mesh: the sharding of a [minibatches, rows, ...] stack, rows split like
  # the batch (`mesh.minibatch_sharding`). Without it XLA keeps each minibatch on the few devices
  # that hold its rows; with it every device works on every minibatch. None under pmap.
  minibatch_sharding: Any = None


def sequence_logprobs(params, model: ModelConfig, tokens_BxT, attention_mask_BxT,
                      temperature: float):
  """Teacher-forced log-prob and entropy of each next token: ([B,T-1], [B,T-1]) float32.

  Uses the temperature-scaled distribution softmax(logits / temperature), the same one the sampler
  draws from and reports, so old, new and sampled log-probs are of one distribution.
  """
  logits_BxTxV = transformer.logits(params, model, tokens_BxT[:, :-1], attention_mask_BxT[:, :-1])
  logits_BxTxV = logits_BxTxV / temperature
  logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  target_BxT = tokens_BxT[:, 1:]
  logp_BxT = jnp.take_along_axis(logits_BxTxV, target_BxT[..., None], axis=-1)[..., 0] - logz_BxT
  entropy_BxT = pacing.token_entropy(logits_BxTxV)
  return logp_BxT, entropy_BxT


def _minibatches(batch: dict, order_M: Optional[jax.Array], num: int, sharding=None) -> dict:
  """[b, ...] leaves -> [num, b / num, ...] in the order of `order_M` (None: as they are)."""
  def split(x):
    x = x if order_M is None else x[order_M]
    x = x.reshape((num, x.shape[0] // num) + x.shape[1:])
    return x if sharding is None else lax.with_sharding_constraint(x, sharding)
  return jax.tree_util.tree_map(split, batch)


def _finite(*trees) -> jax.Array:
  leaves = [x for t in trees for x in jax.tree_util.tree_leaves(t)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def train_step(state: TrainState, frozen, batch: dict, rng: jax.Array, *, cfg: StepConfig,
               tx: optax.GradientTransformation):
  """One RL update: old log-probs, pacing, advantages, then PPO epochs x minibatches.

  `batch` (this device's share): tokens / attention_mask / loss_mask [b,T], task_ids / group_ids
  [b] int32, rewards [b] float32 (NaN or inf: the episode is left out). Returns (new state, metrics identical on every device).
  """
  axis = cfg.axis_name
  b = batch["tokens"].shape[0]
  if b % cfg.num_minibatches:
    raise ValueError(f"per-device batch {b} is not divisible by {cfg.num_minibatches} minibatches")
  params = lora.combine(state.trainable, frozen)
  # Position t scores token t + 1. An episode with a non-finite reward (how the trainer marks a
  # failed one) carries no loss token, so it enters neither the loss nor the task entropies.
  valid_B = jnp.isfinite(batch["rewards"])
  loss_mask_BxT = jnp.where(valid_B[:, None], batch["loss_mask"][:, 1:], False)

  # The sampling policy, re-scored teacher-forced: the ratio's denominator and the pacing signal.
  # One minibatch at a time keeps the activation memory of the old-policy pass bounded.
  def score(p, mb):
    return sequence_logprobs(p, cfg.model, mb["tokens"], mb["attention_mask"], cfg.temperature)
  in_order = _minibatches(batch, None, cfg.num_minibatches, cfg.minibatch_sharding)
  old_logp, entropy = lax.map(lambda mb: score(params, mb), in_order)
  old_logp_BxT, entropy_BxT = (x.reshape((b,) + x.shape[2:]) for x in (old_logp, entropy))
  ref_logp_BxT = None
  if cfg.loss.kl_coef:
    # The reference policy is the base model: the same params with the adapters left out.
    ref_params = lora.base_params(params)
    ref_logp_BxT = lax.map(lambda mb: score(ref_params, mb)[0], in_order).reshape(b, -1)

  # EPPO: task entropies of the sampling policy -> smoothed state -> per-task bounds.
  ent_K, cnt_K = pacing.task_entropy(entropy_BxT, loss_mask_BxT, batch["task_ids"],
                                     cfg.num_tasks, axis)
  diagnostics = pacing.pacing_diagnostics(state.pacing, ent_K, cnt_K, cfg.pacing)
  healthy = jnp.all(jnp.isfinite(ent_K))
  new_pacing = pacing.update_pacing(state.pacing, ent_K, cnt_K, cfg.pacing)
  new_pacing = jax.tree_util.tree_map(lambda n, o: jnp.where(healthy, n, o), new_pacing,
                                      state.pacing)
  eps_low_K, eps_high_K = pacing.pacing_bounds(new_pacing, cfg.pacing)

  advantages_B = objective.grpo_advantages(
      batch["rewards"], batch["group_ids"], cfg.num_groups, estimator=cfg.advantage_estimator,
      task_ids=batch["task_ids"], num_tasks=cfg.num_tasks, per_task_std=cfg.per_task_std,
      axis_name=axis)

  data = dict(batch, old_logp=old_logp_BxT, advantages=advantages_B, loss_mask=loss_mask_BxT)
  if ref_logp_BxT is not None:
    data["ref_logp"] = ref_logp_BxT

  def loss_fn(trainable, mb, key):
    logp_BxT, ent_BxT = score(lora.combine(trainable, frozen), mb)
    return objective.eppo_loss(
        logp_BxT, mb["old_logp"], mb["advantages"], mb["loss_mask"], mb["task_ids"], eps_low_K,
        eps_high_K, mb.get("ref_logp"), ent_BxT, cfg=cfg.loss, axis_name=axis,
        num_tasks=cfg.num_tasks, rng=key)

  def update(carry, xs):
    trainable, opt_state = carry
    mb, key = xs
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, mb, key)
    grads = grads if axis is None else lax.pmean(grads, axis)
    # A non-finite loss or gradient skips this update; the host counts skips and stops the run
    # after several in a row.
    ok = jnp.isfinite(loss) & _finite(grads)
    if axis is not None:
      ok = lax.pmin(ok.astype(jnp.int32), axis) > 0  # All devices skip together.

    def apply(operands):
      trainable, opt_state, grads = operands
      updates, opt_state = tx.update(grads, opt_state, trainable)
      return optax.apply_updates(trainable, updates), opt_state

    # A branch, not a select of old and new: the skipped path holds no second copy of the params
    # and optimizer state, which matters for full fine-tuning.
    carry = lax.cond(ok, apply, lambda operands: operands[:2], (trainable, opt_state, grads))
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads), skipped=1 - ok.astype(jnp.int32))
    return carry, metrics

  rng_epochs = jax.random.split(rng, cfg.ppo_epochs)
  carry = (state.trainable, state.opt_state)
  per_update = []
  for epoch in range(cfg.ppo_epochs):
    # The same permutation on every device (same key), so minibatch i is a global minibatch.
    perm_key, loss_key = jax.random.split(rng_epochs[epoch])
    order = jax.random.permutation(perm_key, b) if epoch else None
    keys = jax.random.split(loss_key, cfg.num_minibatches)
    carry, metrics = lax.scan(update, carry, (_minibatches(data, order, cfg.num_minibatches,
                                                           cfg.minibatch_sharding), keys))
    per_update.append(metrics)
  per_update = jax.tree_util.tree_map(lambda *x: jnp.concatenate(x), *per_update)
  metrics = {k: (v.sum(0) if k == "skipped" else v.mean(0)) for k, v in per_update.items()}
  advantage_abs_mean = jnp.mean(jnp.abs(advantages_B))  # This device's share (equal sizes).
  if axis is not None:
    advantage_abs_mean = lax.pmean(advantage_abs_mean, axis)
  metrics.update(
      entropy_K=ent_K, token_count_K=cnt_K, eps_low_K=eps_low_K, eps_high_K=eps_high_K,
      entropy_ema_K=new_pacing.ema_K, entropy_crossovers=diagnostics["entropy_crossovers"],
      entropy_spikes_K=diagnostics["entropy_spikes_K"].astype(jnp.int32),
      num_entropy_spikes=diagnostics["num_entropy_spikes"],
      advantage_abs_mean=advantage_abs_mean, nonfinite_entropy=1 - healthy)
  trainable, opt_state = carry
  new_state = TrainState(step=state.step + 1, trainable=trainable, opt_state=opt_state,
                         pacing=new_pacing)
  return new_state, metrics


def sft_loss(params, model: ModelConfig, batch: dict, axis_name: Optional[str]):
  """Token-mean NLL of the loss-masked (assistant) tokens; under pmap N_devices x this share."""
  logp_BxT, _ = sequence_logprobs(params, model, batch["tokens"], batch["attention_mask"], 1.0)
  mask_BxT = batch["loss_mask"][:, 1:].astype(jnp.float32)
  total, count = jnp.sum(-logp_BxT * mask_BxT), jnp.sum(mask_BxT)
  if axis_name is None:
    return total / jnp.maximum(count, 1.0)
  # Same convention as eppo_loss: the normaliser is global, the numerator local, so the pmean of
  # the gradients is the gradient of the global token mean.
  return total / jnp.maximum(lax.psum(count, axis_name), 1.0) * lax.psum(1, axis_name)


def sft_step(trainable, opt_state, frozen, batch: dict, *, model: ModelConfig,
             tx: optax.GradientTransformation, axis_name: Optional[str] = "data"):
  """One supervised update on expert demonstrations -> (trainable, opt_state, metrics)."""
  loss_fn = lambda t: sft_loss(lora.combine(t, frozen), model, batch, axis_name)
  loss, grads = jax.value_and_grad(loss_fn)(trainable)
  if axis_name is not None:
    loss, grads = lax.pmean((loss, grads), axis_name)
  updates, opt_state = tx.update(grads, opt_state, trainable)
  return (optax.apply_updates(trainable, updates), opt_state,
          {"sft_loss": loss, "sft_grad_norm": optax.tree.norm(grads)})
