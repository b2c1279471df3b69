"""Checks a training config before anything is built: every field's range, names and choices.

`validate(config)` raises `ConfigError` (a ValueError) naming the field by its dotted path, e.g.
"config.optim.learning_rate=-0.001 must be > 0". It runs before the tiny model is built or an HF
checkpoint is loaded, so a typo costs a second, not an SFT stage.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
from typing import Any, Callable

import jax
import ml_collections

from eppo_jax import agent, mesh, objective, programs, steps
from eppo_jax.envs import registry
from eppo_jax.envs.sampler import EVAL_SEED_OFFSET
from eppo_jax.models.config import ATTENTION_IMPLS

ENV_BACKENDS = ("auto",) + agent.ENV_BACKENDS
# "auto": bfloat16 on TPUs and on GPUs from Ampere on, float32 elsewhere (`programs.model_dtype`).
DTYPES = ("float32", "bfloat16", "float16", "auto")
# Built-in tasks whose envs are pure Python and fast: the "auto" backend steps them inline.
TRUSTED_TASKS = ("sokoban", "frozenlake", "countdown")


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field."""


def _positive(x) -> bool:
  return x > 0


def _at_least(n) -> Callable[[Any], bool]:
  return lambda x: x >= n


# Dotted field -> (test, what the test means). Fields not listed here are checked below.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.tiny_hidden_size": (_at_least(1), ">= 1"),
    "model.tiny_intermediate_size": (_at_least(1), ">= 1"),
    "model.tiny_num_layers": (_at_least(1), ">= 1"),
    "model.tiny_num_heads": (_at_least(1), ">= 1"),
    "model.tiny_num_kv_heads": (_at_least(1), ">= 1"),
    "model.tiny_vocab_size": (_at_least(64), ">= 64"),
    "model.lora_rank": (_at_least(0), ">= 0"),
    "model.attention_block_q": (_at_least(1), ">= 1"),
    "rollout.prefill_chunk": (_at_least(0), ">= 0 (0 = a turn's whole chunk at once)"),
    "model.attention_block_k": (_at_least(1), ">= 1"),
    "model.lora_alpha": (_positive, "> 0"),
    "tasks.env_workers": (_at_least(0), ">= 0"),
    "tasks.step_timeout_s": (_positive, "> 0"),
    "tasks.train_instances": (lambda x: 0 <= x <= EVAL_SEED_OFFSET,
                              f"in [0, {EVAL_SEED_OFFSET}] (0 = every training seed)"),
    "rollout.instances_per_step": (_at_least(1), ">= 1"),
    "rollout.group_size": (_at_least(2), ">= 2 (group advantages need >= 2)"),
    "rollout.max_turns": (_at_least(1), ">= 1"),
    "rollout.max_new_tokens": (_at_least(1), ">= 1"),
    "rollout.max_episode_tokens": (_at_least(1), ">= 1"),
    "rollout.temperature": (_positive, "> 0 (use greedy evaluation for argmax decoding)"),
    "rollout.top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "rollout.top_k": (_at_least(0), ">= 0 (0 = off)"),
    "optim.learning_rate": (_positive, "> 0"),
    "optim.warmup_steps": (_at_least(0), ">= 0"),
    "optim.weight_decay": (_at_least(0), ">= 0"),
    "optim.grad_clip": (_positive, "> 0"),
    "optim.ppo_epochs": (_at_least(1), ">= 1"),
    "optim.num_minibatches": (_at_least(1), ">= 1"),
    "optim.micro_batches": (_at_least(1), ">= 1"),
    "sft.demos_per_task": (_at_least(1), ">= 1"),
    "sft.steps": (_at_least(0), ">= 0"),
    "sft.batch_size": (_at_least(1), ">= 1"),
    "sft.learning_rate": (_positive, "> 0"),
    "train.num_steps": (_at_least(0), ">= 0"),
    "train.eval_every": (_at_least(0), ">= 0 (0 = only at the end)"),
    "train.eval_instances_per_task": (_at_least(1), ">= 1"),
    "train.checkpoint_every": (_at_least(1), ">= 1"),
    "train.checkpoint_keep": (_at_least(1), ">= 1"),
    "train.max_bad_steps": (_at_least(1), ">= 1"),
    "distributed.num_processes": (_at_least(0), ">= 0"),
    "distributed.heartbeat_timeout_s": (_at_least(1), ">= 1 (seconds)"),
    "rollout.extra_rounds": (_at_least(0), ">= 0"),
    "rollout.keep_groups": (lambda x: 0 < x <= 1, "in (0, 1] (1 = keep every group)"),
    "gigpo.gamma": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "gigpo.omega": (_at_least(0), ">= 0"),
}
CHOICES: dict[str, tuple] = {
    "method": objective.METHODS,
    # "gigpo" is computed on the host (eppo_jax.gigpo), not in objective's registry.
    "advantage_estimator": tuple(objective.ADVANTAGE_ESTIMATORS) + ("gigpo",),
    "optim.old_logprobs": steps.OLD_LOGPROBS,
    "sft.schedule": programs.SFT_SCHEDULES,
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.attention_impl": ATTENTION_IMPLS + ("auto",),
    "tasks.system_prompt": agent.SYSTEM_PROMPTS,
    "tasks.env_backend": ENV_BACKENDS,
    "distributed.initialize": ("auto", "on", "off"),
}


def lookup(config: ml_collections.ConfigDict, path: str) -> Any:
  """The value at dotted `path`; KeyError naming the first missing part."""
  node = config
  for i, key in enumerate(path.split(".")):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or key not in node:
      raise KeyError(".".join(path.split(".")[:i + 1]))
    node = node[key]
  return node


def unknown_field(config: ml_collections.ConfigDict, path: str) -> str | None:
  """The dotted prefix of `path` that `config` lacks ("train.foo"), or None if it exists."""
  try:
    lookup(config, path)
  except KeyError as e:
    return e.args[0]
  return None


def _fail(path: str, value: Any, why: str) -> ConfigError:
  return ConfigError(f"config.{path}={value!r} {why}")


def check_ranges(config: ml_collections.ConfigDict) -> None:
  """Every listed numeric field in range, finite, and every choice field a valid choice."""
  for path, (ok, meaning) in RANGES.items():
    value = lookup(config, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise _fail(path, value, "must be a number")
    if not math.isfinite(value) or not ok(value):
      raise _fail(path, value, f"must be {meaning}")
  for path, valid in CHOICES.items():
    value = lookup(config, path)
    if value not in valid:
      raise _fail(path, value, f"is unknown; valid: {', '.join(valid)}")


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a bad config before anything is built or compiled, naming the field."""
  check_ranges(config)
  objective.method_configs(config.method, **dict(config.pacing.overrides),
                           **dict(config.loss.overrides))
  m = config.model
  if m.source == "tiny" and m.tiny_num_heads % m.tiny_num_kv_heads:
    raise _fail("model.tiny_num_kv_heads", m.tiny_num_kv_heads,
                f"must divide config.model.tiny_num_heads={m.tiny_num_heads}")
  if m.source == "tiny" and m.tiny_hidden_size % m.tiny_num_heads:
    raise _fail("model.tiny_hidden_size", m.tiny_hidden_size,
                f"must be a multiple of config.model.tiny_num_heads={m.tiny_num_heads}")
  if not config.tasks.specs:
    raise ConfigError("config.tasks.specs is empty")
  for spec in config.tasks.specs:
    try:
      registry.make(spec).close()  # Unknown task or level -> an error that lists the valid ones.
    except (KeyError, ValueError) as e:
      raise ConfigError(f"config.tasks.specs: {e}") from e
  weights = config.tasks.weights
  if weights and len(weights) != len(config.tasks.specs):
    raise ConfigError(f"config.tasks.weights has {len(weights)} entries for "
                      f"{len(config.tasks.specs)} tasks")
  if weights and (any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0):
    raise _fail("tasks.weights", tuple(weights), "must be finite, >= 0, and not all 0")
  r = config.rollout
  episodes = r.instances_per_step * r.group_size
  try:
    data, fsdp, _ = mesh.mesh_shape(config.mesh, jax.device_count())
  except ValueError as e:
    raise ConfigError(str(e)) from e
  shards = data * fsdp  # The batch is split over data x fsdp.
  if episodes % shards:
    raise ConfigError(f"config.rollout.instances_per_step x group_size = {episodes} episodes is "
                      f"not divisible by the {shards} batch shards (config.mesh data x fsdp)")
  if r.instances_per_step % jax.process_count():
    raise ConfigError(f"config.rollout.instances_per_step={r.instances_per_step} does not split "
                      f"over {jax.process_count()} hosts")
  if shards < jax.process_count():
    raise ConfigError(f"config.mesh data x fsdp = {shards} batch shards for {jax.process_count()} "
                      "hosts: every host needs a batch shard of its own (raise mesh.data)")
  per_shard = episodes // shards
  o = config.optim
  if per_shard % o.num_minibatches:
    raise ConfigError(f"{per_shard} episodes per batch shard are not divisible by "
                      f"config.optim.num_minibatches={o.num_minibatches}")
  if (per_shard // o.num_minibatches) % o.micro_batches:
    raise ConfigError(f"{per_shard // o.num_minibatches} episodes per batch shard and minibatch "
                      f"are not divisible by config.optim.micro_batches={o.micro_batches}")
  if o.share_prompt and r.instances_per_step % o.num_minibatches:
    raise ConfigError(f"config.optim.share_prompt needs minibatches of whole groups: "
                      f"instances_per_step={r.instances_per_step} is not divisible by "
                      f"num_minibatches={o.num_minibatches} (or set share_prompt=False)")
  if o.share_prompt and r.instances_per_step % (o.num_minibatches * o.micro_batches):
    raise ConfigError(f"config.optim.share_prompt needs micro-batches of whole groups: "
                      f"instances_per_step={r.instances_per_step} is not divisible by "
                      f"num_minibatches x micro_batches = {o.num_minibatches * o.micro_batches} "
                      f"(or set share_prompt=False)")
  if config.loss.overrides.get("kl_coef", 0.0) and not m.lora_rank:
    raise ConfigError("config.loss.overrides.kl_coef needs LoRA (config.model.lora_rank > 0): "
                      "the KL reference is the base model with the adapters switched off")
  if m.lora_rank and not m.lora_targets:
    raise ConfigError("config.model.lora_targets is empty but config.model.lora_rank > 0")
  if r.max_new_tokens + 32 > r.max_episode_tokens:
    raise ConfigError(f"config.rollout.max_episode_tokens={r.max_episode_tokens} leaves no room "
                      f"for a prompt next to max_new_tokens={r.max_new_tokens}")
  if config.per_task_std and config.advantage_estimator != "grpo":
    raise _fail("per_task_std", config.per_task_std, "only changes advantage_estimator='grpo' "
                "(drgrpo and rloo do not divide by a std, gigpo keeps its statistics within a "
                f"group); got {config.advantage_estimator!r}")
  if not isinstance(config.gigpo.step_normalize, bool):
    raise _fail("gigpo.step_normalize", config.gigpo.step_normalize, "must be True or False")
  if config.train.wandb_project and importlib.util.find_spec("wandb") is None:
    raise ConfigError("config.train.wandb_project is set but wandb is not installed: "
                      "pip install 'eppo_jax[wandb]'")
  if config.sft.enabled and config.sft.steps < 1:
    raise _fail("sft.steps", config.sft.steps, "must be >= 1 when config.sft.enabled")
  demos = config.sft.demos_per_task * len(config.tasks.specs)
  if config.sft.enabled and demos < jax.process_count():  # Each host plays its share of them.
    raise ConfigError(f"config.sft.demos_per_task x tasks = {demos} demonstrations for "
                      f"{jax.process_count()} hosts: every host needs one at least (raise "
                      "sft.demos_per_task)")


def env_backend(config: ml_collections.ConfigDict) -> str:
  """The backend that `config.tasks.env_backend` names; "auto" resolves per task list.

  "auto" steps the trusted built-in tasks inline, and anything else (TextWorld, a registered
  task) in worker processes, where a hang is killed; a task whose factory cannot be pickled for
  a worker falls back to threads (the timeout holds, but a hung call is only abandoned).
  """
  backend = config.tasks.env_backend
  if backend != "auto":
    return backend
  names = [registry.parse_task_spec(spec)[0] for spec in config.tasks.specs]
  if all(name in TRUSTED_TASKS for name in names):
    return "inline"
  try:
    for spec in config.tasks.specs:
      pickle.dumps(registry.factory(spec))
  except Exception:  # Any pickling failure means: not buildable in a worker.
    return "threads"
  return "processes"
