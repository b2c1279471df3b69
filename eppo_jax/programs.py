"""Config -> programs: every configuration object and compiled program a run needs, built here.

The trainer (`eppo_jax.train`) and the fit tool (`eppo_jax.fit`) both take their programs from this
module, so what the fit tool compiles for a TPU slice is what the trainer runs:

    model_config     the ModelConfig: the checkpoint's shape plus how `config.model` computes it
    model_dtype      `config.model.dtype` / `param_dtype` for a device ("auto" resolved)
    sampling_config  how the rollout draws tokens
    step_config      the static description of one RL update (`steps.StepConfig`)
    optimizer        the RL and SFT optimizers
    init_state       the train state (params partitioned, optimizer and pacing state)
    batch_spec       the keys, shapes and dtypes of the update's global batch
    jit_update       `steps.train_step` as one program over the mesh, its state donated
    jit_sft          `steps.sft_step` likewise
    rollout_turn     one rollout turn (`sampling.rollout` on a KV cache) over the mesh

The LoRA-masked optimizer. The design asks for an optax optimizer that updates only the adapters
(`lora.masked_optimizer`: `optax.multi_transform` with `set_to_zero` on the base). The trainer uses
its exact, cheaper form: the params are partitioned into the trainable leaves and the frozen rest
(`lora.partition`), the optimizer sees the trainable leaves only, and the frozen base is passed to
the update as a constant. Both give the same update bit for bit (tests/test_lora.py); the partition
computes no gradient for the base and keeps no zero state for it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from eppo_jax import agent, objective, pacing, steps
from eppo_jax import mesh as meshlib
from eppo_jax.models import attention
from eppo_jax.models.config import LoraConfig, ModelConfig
from eppo_jax.models.transformer import forward_with_cache, init_cache
from eppo_jax.sampling import SamplingConfig, rollout_body

# The update's batch: keys read by every update, and those the sampler adds for
# `optim.old_logprobs="sampler"`.
BATCH_KEYS = ("tokens", "attention_mask", "loss_mask", "task_ids", "group_ids", "rewards")
SAMPLER_KEYS = ("logprobs", "entropies")


def model_config(config: ml_collections.ConfigDict, base: ModelConfig,
                 device=None) -> ModelConfig:
  """`base` (a checkpoint's shape and dtypes) computed as `config.model` asks on `device` (default
  this process's first): `attention_impl="auto"` becomes the kernel of its chip
  (`attention.resolve`)."""
  m = config.model
  platform = (device or jax.devices()[0]).platform
  impl = attention.resolve(m.attention_impl, platform, base.dtype)
  return base.replace(remat=m.remat, attention_impl=impl,
                      attention_block_q=m.attention_block_q, attention_block_k=m.attention_block_k)


def model_dtype(name: str, device=None) -> str:
  """A `config.model.dtype` or `param_dtype` value as a dtype name for `device` (default: this
  process's first). "auto" is bfloat16 where the chip computes in it natively (TPUs, GPUs from
  Ampere on: compute capability >= 8.0) and float32 elsewhere (CPUs, a T4 or V100)."""
  if name != "auto":
    return name
  device = device or jax.devices()[0]
  if device.platform == "tpu":
    return "bfloat16"
  if device.platform == "gpu":
    return "bfloat16" if float(getattr(device, "compute_capability", 0) or 0) >= 8.0 else "float32"
  return "float32"


def lora_config(config: ml_collections.ConfigDict) -> Optional[LoraConfig]:
  """The adapters `config.model` asks for; None for full fine-tuning."""
  m = config.model
  if not m.lora_rank:
    return None
  return LoraConfig(rank=m.lora_rank, alpha=m.lora_alpha, targets=tuple(m.lora_targets))


def sampling_config(config: ml_collections.ConfigDict, stop_token_ids, pad_id: int,
                    greedy: bool) -> SamplingConfig:
  r = config.rollout
  return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                        top_k=r.top_k, greedy=greedy, stop_token_ids=tuple(stop_token_ids),
                        pad_id=pad_id)


def step_config(config: ml_collections.ConfigDict, model: ModelConfig,
                mesh: jax.sharding.Mesh) -> steps.StepConfig:
  """The static description of one RL update that `config` asks for, on `mesh`."""
  r, o = config.rollout, config.optim
  pacing_cfg, loss_cfg = objective.method_configs(
      config.method, **dict(config.pacing.overrides), **dict(config.loss.overrides))
  return steps.StepConfig(
      model=model, pacing=pacing_cfg, loss=loss_cfg, num_tasks=len(config.tasks.specs),
      num_groups=r.instances_per_step, temperature=r.temperature, ppo_epochs=o.ppo_epochs,
      num_minibatches=o.num_minibatches, micro_batches=o.micro_batches,
      advantage_estimator=config.advantage_estimator,
      per_task_std=config.per_task_std, minibatch_sharding=meshlib.minibatch_sharding(mesh),
      # A reply has at most max_new_tokens loss tokens per turn.
      loss_tokens_per_row=agent.round_up(r.max_turns * r.max_new_tokens, 32),
      old_logprobs=o.old_logprobs, group_size=r.group_size)


SFT_SCHEDULES = ("constant", "cosine")


def make_optimizer(lr: float, warmup: int, weight_decay: float, grad_clip: float,
                   decay_steps: int = 0) -> optax.GradientTransformation:
  """AdamW (b2 0.99) after global-norm clipping, with a linear warm-up over `warmup` updates,
  then `lr` held, or with `decay_steps` (the updates in all) a cosine decay to 0 at the last."""
  if decay_steps:  # At least one step after the warm-up (optax needs one to decay over).
    warmup = max(warmup, 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(decay_steps, warmup + 1))
  else:
    schedule = optax.linear_schedule(0.0, lr, max(warmup, 1)) if warmup else lr
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay))


def optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The RL update's optimizer (`config.optim`)."""
  o = config.optim
  return make_optimizer(o.learning_rate, o.warmup_steps, o.weight_decay, o.grad_clip)


def sft_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The warm start's optimizer (`config.sft`): warm-up over a tenth of its steps, then
  `sft.schedule`."""
  s = config.sft
  return make_optimizer(s.learning_rate, max(1, s.steps // 10), 0.0, 1.0,
                        decay_steps=s.steps if s.schedule == "cosine" else 0)


def init_state(config: ml_collections.ConfigDict, trainable,
               tx: optax.GradientTransformation) -> steps.TrainState:
  """The state before RL step 1 (host or abstract values; `hosts.put` places them)."""
  return steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable,
                          opt_state=tx.init(trainable),
                          pacing=pacing.init_pacing(len(config.tasks.specs)))


def batch_spec(config: ml_collections.ConfigDict, step_cfg: steps.StepConfig,
               width: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{key: (global shape, dtype)} of the update's batch for episodes of `width` tokens."""
  b = config.rollout.instances_per_step * config.rollout.group_size
  spec = dict(tokens=((b, width), np.int32), attention_mask=((b, width), np.bool_),
              loss_mask=((b, width), np.bool_), task_ids=((b,), np.int32),
              group_ids=((b,), np.int32), rewards=((b,), np.float32))
  if step_cfg.old_logprobs == "sampler":  # The rollout's numbers travel with the batch.
    spec.update({k: ((b, width), np.float32) for k in SAMPLER_KEYS})
  if step_cfg.advantage_estimator in steps.TOKEN_ADVANTAGES:  # Computed on the host.
    spec["advantages"] = ((b, width), np.float32)
  if step_cfg.pacing.entropy_tokens == "action":  # Pacing reads the action tokens' entropy.
    spec["action_mask"] = ((b, width), np.bool_)
  return spec


def jit_update(step_cfg: steps.StepConfig, tx, state_sharding, frozen_sharding,
               mesh: jax.sharding.Mesh, shared_prefix: int = 0):
  """`steps.train_step` as one program over `mesh`, the state donated. With `shared_prefix`, each
  group's first `shared_prefix` tokens run once per group (`StepConfig.shared_prefix`)."""
  cfg = dataclasses.replace(step_cfg, shared_prefix=shared_prefix)
  return jax.jit(functools.partial(steps.train_step, cfg=cfg, tx=tx),
                 in_shardings=(state_sharding, frozen_sharding, meshlib.batch_sharding(mesh),
                               meshlib.replicated(mesh)),
                 out_shardings=(state_sharding, meshlib.replicated(mesh)), donate_argnums=(0,))


def jit_sft(model: ModelConfig, tx, trainable_sharding, opt_sharding, frozen_sharding,
            mesh: jax.sharding.Mesh, micro_batches: int = 1):
  """`steps.sft_step` as one program over `mesh`, the params and optimizer state donated; its
  gradient accumulated over `micro_batches` parts of the batch."""
  step = functools.partial(steps.sft_step, model=model, tx=tx, micro_batches=micro_batches,
                           minibatch_sharding=meshlib.minibatch_sharding(mesh))
  return jax.jit(step,
                 in_shardings=(trainable_sharding, opt_sharding, frozen_sharding,
                               meshlib.batch_sharding(mesh)),
                 out_shardings=(trainable_sharding, opt_sharding, meshlib.replicated(mesh)),
                 donate_argnums=(0, 1))


def _turn(params, tokens, mask, rng, row_ids, cache, *, config, sampling, window):
  out = rollout_body(params, config, tokens, mask, rng, sampling, cache, window=window,
                     row_ids_B=row_ids)
  return out.tokens, out.mask, out.cache, (out.logprobs, out.entropies)


def _prefill(params, tokens, mask, cache, *, config, window):
  """Writes a chunk into the cache without sampling (the head runs at its last column only)."""
  return forward_with_cache(params, config, tokens, mask, cache, window, head="last")[1]


def _take_rows(cache, rows_R):
  """The cache of the rows `rows_R`, in that order (a gather over the batch axis)."""
  return {**cache, "k": cache["k"][:, rows_R], "v": cache["v"][:, rows_R],
          "mask": cache["mask"][rows_R], "pos": cache["pos"][rows_R]}


@dataclasses.dataclass(frozen=True)
class RolloutPrograms:
  """The programs of one rollout turn over a mesh, for a global batch and cache size."""

  empty_cache: object  # () -> an all-empty cache, placed on the mesh.
  # (params, tokens, mask, key, row ids, cache) -> (reply, reply mask, cache, scores); a row draws
  # from the key folded with its id (`sampling.rollout_body`).
  turn: object
  prefill: object  # (params, tokens, mask, cache) -> cache: a chunk written without sampling.
  compact: object  # (cache, rows) -> the cache of those (global) rows.


@functools.lru_cache(maxsize=None)
def rollout_turn(model: ModelConfig, sampling: SamplingConfig, mesh: jax.sharding.Mesh,
                 batch: int, max_len: int, window: int) -> RolloutPrograms:
  """One rollout turn for `batch` rows and a `max_len`-slot cache, attending over its first
  `window` slots (static), jitted on `mesh`.

  The params keep the shardings they were placed with (`mesh.shardings`); rows and the cache are
  split over data x fsdp, kv heads over tensor (`mesh.cache_shardings`).
  """
  cache_sh = meshlib.cache_shardings(mesh, model.num_kv_heads)
  rows, replicated = meshlib.batch_sharding(mesh), meshlib.replicated(mesh)
  # The empty cache is made by its own program and passed in, so that the first turn and every
  # later one run the same turn program (and its zeros are no constants for XLA to fold).
  empty = jax.jit(lambda: init_cache(model, batch, max_len), out_shardings=cache_sh)
  turn = jax.jit(functools.partial(_turn, config=model, sampling=sampling, window=window),
                 in_shardings=(None, rows, rows, replicated, rows, cache_sh),
                 out_shardings=(rows, rows, cache_sh, (rows, rows)), donate_argnums=(5,))
  prefill = jax.jit(functools.partial(_prefill, config=model, window=window),
                    in_shardings=(None, rows, rows, cache_sh), out_shardings=cache_sh,
                    donate_argnums=(3,))
  # The kept rows' global indices come split like the rows: each host names its own. No donation:
  # the smaller output cannot reuse the input's buffer.
  compact = jax.jit(_take_rows, in_shardings=(cache_sh, rows), out_shardings=cache_sh)
  return RolloutPrograms(empty, turn, prefill, compact)
