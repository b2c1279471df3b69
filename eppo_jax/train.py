"""The training run: model setup, SFT warm start, the RL loop, evaluation, checkpoints and logs.

One RL step: sample task instances -> play G episodes of each with the current policy (host
environments, device `rollout`) -> `steps.train_step` (pacing, advantages, PPO updates) on all
devices -> log; every few steps greedy evaluation on held-out seeds and a checkpoint.

Every device program is `jax.jit` over the `config.mesh` device mesh (see `eppo_jax.mesh`): the
params, adapters and optimizer state live sharded on it, batches enter as global arrays split over
data x fsdp, and the steps run with `axis_name=None` on the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from eppo_jax import (agent, config_check, interrupt, lora, objective, pacing, parallel, steps,
                      workdir as workdir_lib)
from eppo_jax import mesh as meshlib
from eppo_jax.checkpoint import Checkpointer
from eppo_jax.envs import registry
from eppo_jax.envs.sampler import TaskSampler
from eppo_jax.metrics import MetricsLogger
from eppo_jax.models import hf, tiny
from eppo_jax.models.config import LoraConfig
from eppo_jax.policy import ModelPolicy
from eppo_jax.sampling import SamplingConfig

_DEMO_SEED = 1_000_000  # First seed of the SFT demonstrations.
# The root key is split once into these purposes; per-step keys are `fold_in(key, step)`, so a
# resumed run draws the same numbers as an uninterrupted one.
_KEY_PURPOSES = ("rollout", "train", "eval", "lora")
_BATCH_KEYS = ("tokens", "attention_mask", "loss_mask", "task_ids", "group_ids", "rewards")
_SAMPLER_KEYS = ("logprobs", "entropies")  # Read by train_step with optim.old_logprobs="sampler".
# Consecutive steps in which every group's rewards were equal (all advantages 0) before the run
# warns: a policy that has collapsed to one outcome on every instance gets no gradient back out.
_NO_SIGNAL_STEPS = 5

log = logging.getLogger(__name__)


def named_keys(seed: int) -> dict:
  """{purpose: key} derived from the config seed."""
  root = jax.random.PRNGKey(seed)
  return {name: jax.random.fold_in(root, i) for i, name in enumerate(_KEY_PURPOSES)}


validate = config_check.validate  # Kept under its old name for callers of train.validate.


def _tokenizer_corpus(specs, per_task: int = 40, stepper=None) -> list[str]:
  """Texts the tiny tokenizer is trained on: instructions, observations and expert replies."""
  corpus = []
  for spec in specs:
    env = registry.make(spec)
    header = [env.instructions, f"Task: {env.task_name}"]
    env.close()
    instances = [agent.Instance(0, spec, 10_000 + seed) for seed in range(per_task)]
    for observations, actions in agent.expert_transcripts(registry.make, instances, stepper):
      corpus += header + observations[:1]
      for action, observation in zip(actions, observations[1:]):
        corpus += [agent.format_action(action), observation]
  return corpus


def make_stepper(config) -> agent.EnvStepper:
  """How this config's environments are stepped (`config.tasks.env_backend`)."""
  t = config.tasks
  backend = config_check.env_backend(config)
  untrusted = [s for s in t.specs
               if registry.parse_task_spec(s)[0] not in config_check.TRUSTED_TASKS]
  if backend == "inline" and untrusted:
    log.warning("config.tasks.env_backend='inline' cannot enforce step_timeout_s: a hang in %s "
                "hangs the run (use 'processes')", ", ".join(untrusted))
  return agent.EnvStepper(t.env_workers, t.step_timeout_s, backend)


def model_options(config) -> dict:
  """The `config.model` fields that set how the model computes (ModelConfig fields)."""
  m = config.model
  return dict(remat=m.remat, attention_impl=m.attention_impl,
              attention_block_q=m.attention_block_q, attention_block_k=m.attention_block_k)


def load_model(config, workdir: Path):
  """(ModelConfig, params, tokenizer): the tiny model built locally, or an HF checkpoint."""
  m = config.model
  if m.source == "tiny":
    spec = tiny.TinySpec(vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size,
                         intermediate_size=m.tiny_intermediate_size, num_layers=m.tiny_num_layers,
                         num_heads=m.tiny_num_heads, num_kv_heads=m.tiny_num_kv_heads,
                         seed=config.seed)
    directory = Path(m.tiny_dir or workdir_lib.tiny_model_dir(workdir))
    if jax.process_index() == 0:  # One writer; the other hosts read it after the barrier.
      tiny.build_tiny_model(directory, _tokenizer_corpus(config.tasks.specs,
                                                         stepper=make_stepper(config)), spec)
    parallel.barrier("tiny_model")
    source = directory
  else:
    source = m.source
  pre = hf.load_pretrained(source, dtype=jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype))
  model_cfg = pre.config.replace(**model_options(config))
  params = pre.params
  if m.lora_rank:
    lora_cfg = LoraConfig(rank=m.lora_rank, alpha=m.lora_alpha, targets=tuple(m.lora_targets))
    model_cfg, params = lora.add_lora(params, model_cfg, lora_cfg, named_keys(config.seed)["lora"])
  return model_cfg, params, pre.tokenizer


def step_config(config: ml_collections.ConfigDict, model_cfg,
                mesh: Optional[jax.sharding.Mesh] = None) -> steps.StepConfig:
  """The static description of one RL update that `config` asks for.

  With `mesh`, the update runs as one jitted program over it (no axis name: XLA inserts the
  collectives); without, it is the per-device function for `jax.pmap(axis_name="data")`.
  """
  mesh_fields = {} if mesh is None else dict(
      axis_name=None, minibatch_sharding=meshlib.minibatch_sharding(mesh))
  pacing_cfg, loss_cfg = objective.method_configs(
      config.method, **dict(config.pacing.overrides), **dict(config.loss.overrides))
  return steps.StepConfig(
      model=model_cfg, pacing=pacing_cfg, loss=loss_cfg, num_tasks=len(config.tasks.specs),
      num_groups=config.rollout.instances_per_step, temperature=config.rollout.temperature,
      ppo_epochs=config.optim.ppo_epochs, num_minibatches=config.optim.num_minibatches,
      advantage_estimator=config.advantage_estimator, per_task_std=config.per_task_std,
      # A reply has at most max_new_tokens loss tokens per turn.
      loss_tokens_per_row=agent.bucket(config.rollout.max_turns * config.rollout.max_new_tokens, 32),
      old_logprobs=config.optim.old_logprobs, **mesh_fields)


def jit_update(step_cfg: steps.StepConfig, tx, state_sharding, frozen_sharding, mesh,
               shared_prefix: int = 0, group_size: int = 1):
  """`steps.train_step` compiled as the trainer runs it: one program over `mesh` (`step_cfg` from
  `step_config(..., mesh)`), the state donated. With `shared_prefix`, each group of `group_size`
  consecutive rows runs its first `shared_prefix` tokens once (`StepConfig.shared_prefix`)."""
  cfg = dataclasses.replace(step_cfg, shared_prefix=shared_prefix,
                            group_size=group_size if shared_prefix else 1)
  return jax.jit(functools.partial(steps.train_step, cfg=cfg, tx=tx),
                 in_shardings=(state_sharding, frozen_sharding, meshlib.batch_sharding(mesh),
                               meshlib.replicated(mesh)),
                 out_shardings=(state_sharding, meshlib.replicated(mesh)), donate_argnums=(0,))


def shares_prompt(config) -> bool:
  """Whether the update runs each group's prompt once (`optim.share_prompt`): it needs minibatches
  of whole groups (the global batch of instances x group_size splits into num_minibatches)."""
  return bool(config.optim.share_prompt
              and not config.rollout.instances_per_step % config.optim.num_minibatches)


def make_optimizer(lr: float, warmup: int, weight_decay: float, grad_clip: float):
  schedule = optax.linear_schedule(0.0, lr, max(warmup, 1)) if warmup else lr
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay))


@dataclasses.dataclass
class Run:
  """Everything the loop needs that does not change between steps."""

  config: ml_collections.ConfigDict
  model: object
  tokenizer: object
  chat: agent.ChatFormat
  frozen: object  # Non-trainable params, placed on `mesh`.
  task_names: list
  stepper: agent.EnvStepper
  mesh: jax.sharding.Mesh

  def policy(self, trainable, rng, greedy: bool) -> ModelPolicy:
    r = self.config.rollout
    sampling = SamplingConfig(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        greedy=greedy, stop_token_ids=self.chat.stop_token_ids,
        pad_id=self.tokenizer.pad_token_id)
    params = lora.combine(trainable, self.frozen)  # Dict surgery on device arrays: no copy.
    return ModelPolicy(params, self.model, sampling, r.max_episode_tokens, rng, self.mesh,
                       prefill_chunk=r.prefill_chunk)

  def play(self, policy, instances, group_size: int) -> agent.EpisodeBatch:
    r = self.config.rollout
    return agent.collect_episodes(
        policy, self.chat, registry.make, instances, group_size, max_turns=r.max_turns,
        max_new_tokens=r.max_new_tokens, max_slots=r.max_episode_tokens, stepper=self.stepper,
        pad_id=self.tokenizer.pad_token_id)


def _per_task(values: np.ndarray, task_ids: np.ndarray, num_tasks: int,
              valid: np.ndarray | None = None) -> np.ndarray:
  """Mean of the `valid` `values` per task ([K], NaN for tasks with none in the batch)."""
  valid = np.ones(len(values), bool) if valid is None else valid
  values = np.where(valid, values, 0.0).astype(np.float64)
  sums = np.bincount(task_ids, weights=values, minlength=num_tasks)
  counts = np.bincount(task_ids, weights=valid.astype(np.float64), minlength=num_tasks)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / counts, np.nan)


def episode_metrics(episodes: agent.EpisodeBatch, num_tasks: int, prefix: str = "") -> tuple:
  """(global scalars, per-task arrays) of a batch of episodes."""
  finite = np.isfinite(episodes.rewards)
  scored = finite & ~episodes.failed  # A failed episode's return is not a score.
  per_task = {
      f"{prefix}success": _per_task(episodes.success, episodes.task_ids, num_tasks),
      f"{prefix}reward": _per_task(episodes.rewards, episodes.task_ids, num_tasks, scored),
      f"{prefix}invalid_actions": _per_task(episodes.invalid_actions, episodes.task_ids,
                                            num_tasks),
      f"{prefix}turns": _per_task(episodes.turns, episodes.task_ids, num_tasks),
      f"{prefix}episode_tokens": _per_task(episodes.num_tokens, episodes.task_ids, num_tasks),
  }
  scalars = {
      f"{prefix}success": episodes.success.mean(),
      # Over the healthy episodes: one inf must not hide the others, nor a crash count as a score.
      f"{prefix}reward": episodes.rewards[scored].mean() if scored.any() else np.nan,
      f"{prefix}env_failures": episodes.failed.sum(),
      f"{prefix}nonfinite_rewards": (~finite).sum(),
      f"{prefix}truncated": episodes.truncated.mean(),
      f"{prefix}response_tokens": episodes.loss_mask.sum(1).mean(),
  }
  if not prefix:  # Training batches (evaluation has no groups and no update).
    scalars["excluded_episodes"] = np.isnan(agent.training_rewards(episodes)).sum()
  return scalars, per_task


def batch_arrays(episodes: agent.EpisodeBatch, group_offset: int, sampler: bool = False) -> dict:
  """The train_step inputs, padded to a sequence length that every host agrees on; episodes left
  out of the update carry a NaN reward (`agent.training_rewards`). `sampler` adds the sampler's
  per-token log-probs and entropies."""
  arrays = {k: getattr(episodes, k) for k in _BATCH_KEYS + (_SAMPLER_KEYS if sampler else ())}
  arrays["rewards"] = agent.training_rewards(episodes)
  arrays["group_ids"] = arrays["group_ids"] + group_offset  # Globally unique over hosts.
  width = parallel.global_max(arrays["tokens"].shape[1])
  for key in ("tokens", "attention_mask", "loss_mask") + (_SAMPLER_KEYS if sampler else ()):
    x = arrays[key]
    arrays[key] = np.pad(x, ((0, 0), (0, width - x.shape[1])))
  return arrays


def evaluate(run: Run, trainable, rng, sampler: TaskSampler) -> tuple[dict, dict]:
  """Greedy episodes on each task's fixed held-out seeds -> (scalars, per-task arrays)."""
  n = run.config.train.eval_instances_per_task
  specs = run.config.tasks.specs
  instances = [agent.Instance(k, specs[k], seed) for k, seed in sampler.eval_instances(n)]
  mine = instances[jax.process_index()::jax.process_count()]
  episodes = run.play(run.policy(trainable, rng, greedy=True), mine, 1)
  episodes = agent.EpisodeBatch(**parallel.gather_hosts(dataclasses.asdict(episodes)))
  return episode_metrics(episodes, len(run.task_names), "eval_")


def demonstrations(run: Run) -> agent.EpisodeBatch:
  """Expert episodes for the SFT warm start (this host's share), on training-range seeds."""
  n = run.config.sft.demos_per_task
  instances = [agent.Instance(k, spec, _DEMO_SEED + i)
               for k, spec in enumerate(run.config.tasks.specs) for i in range(n)]
  r = run.config.rollout
  return agent.expert_episodes(run.chat, registry.make,
                               instances[jax.process_index()::jax.process_count()],
                               max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                               max_slots=r.max_episode_tokens, pad_id=run.tokenizer.pad_token_id,
                               stepper=run.stepper)


def sft_stage(run: Run, trainable, logger: MetricsLogger):
  """Supervised warm start on expert demonstrations (assistant tokens only) -> trainable."""
  s = run.config.sft
  demos = demonstrations(run)
  usable = np.flatnonzero(~demos.failed)  # An env that failed mid-demonstration: not a demo.
  if not len(usable):
    raise RuntimeError("every expert demonstration failed (see the environment failures above)")
  log.info("SFT: %d demonstrations (%d failed, left out), %d tokens, %d trained", len(usable),
           len(demos.failed) - len(usable), demos.attention_mask[usable].sum(),
           demos.loss_mask[usable].sum())
  tx = make_optimizer(s.learning_rate, max(1, s.steps // 10), 0.0, 1.0)
  opt_state = jax.jit(tx.init)(trainable)
  opt_state = meshlib.put(opt_state, meshlib.shardings(opt_state, run.mesh))
  place = lambda tree: meshlib.shardings(tree, run.mesh)
  sft = jax.jit(functools.partial(steps.sft_step, model=run.model, tx=tx, axis_name=None),
                in_shardings=(place(trainable), place(opt_state), place(run.frozen),
                              meshlib.batch_sharding(run.mesh)),
                out_shardings=(place(trainable), place(opt_state), meshlib.replicated(run.mesh)),
                donate_argnums=(0, 1))
  rng = np.random.default_rng(run.config.seed)
  local_shards = max(1, meshlib.batch_shards(run.mesh) // jax.process_count())
  per_host = max(local_shards, s.batch_size // jax.process_count())
  per_host -= per_host % local_shards
  arrays = {k: getattr(demos, k)[usable] for k in ("tokens", "attention_mask", "loss_mask")}
  start, loss = time.time(), float("nan")
  for i in range(s.steps):
    pick = rng.choice(len(usable), per_host, replace=len(usable) < per_host)
    # Trim the batch to its longest demonstration (bucketed): fewer pad tokens, few shapes.
    width = parallel.global_max(agent.bucket(int(arrays["attention_mask"][pick].sum(1).max()) + 1,
                                             64))
    batch = meshlib.put_rows({k: v[pick, :width] for k, v in arrays.items()}, run.mesh)
    with jax.set_mesh(run.mesh):  # Traced with the mesh in context: see `mesh.constrain_rows`.
      trainable, opt_state, metrics = sft(trainable, opt_state, run.frozen, batch)
    if i % 5 == 0 or i == s.steps - 1:  # Reading the loss waits for the device: not every step.
      loss = float(meshlib.fetch(metrics)["sft_loss"])
      logger.progress(i + 1, f"loss {loss:.3f}", phase="sft", total=s.steps)
      logger.log(-s.steps + i + 1, {"sft_loss": loss})
  logger.end_progress()
  log.info("SFT: %d steps in %.0fs, final loss %.4f", s.steps, time.time() - start, loss)
  return trainable


def _summary(names, success) -> str:
  """Live per-task success for the progress bar ("-" for a task absent from this batch)."""
  return " ".join(f"{n.split(':')[0][:6]} " + ("-" if np.isnan(s) else f"{s:.2f}")
                  for n, s in zip(names, success))


def use_compilation_cache(directory: str) -> None:
  """Keeps compiled XLA programs in `directory` ("" = off), so a rerun, a resumed run or another
  run of the same shapes loads them instead of compiling again. A cache set before (the
  JAX_COMPILATION_CACHE_DIR variable, or `jax.config`) is left as it is."""
  if directory and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))


def train(config: ml_collections.ConfigDict, workdir) -> dict:
  """Runs (or resumes) the configured job in `workdir`; returns the last logged record.

  Raises `interrupt.Interrupted` after saving a checkpoint when SIGINT or SIGTERM arrives.
  """
  parallel.initialize(config.distributed)
  config_check.validate(config)
  workdir_lib.claim(config, workdir, write=jax.process_index() == 0)
  use_compilation_cache(config.train.compilation_cache)
  with interrupt.StopRequest() as signals:
    return _train(config, workdir_lib.as_path(workdir), signals)


def _train(config: ml_collections.ConfigDict, workdir: Path,
           signals: interrupt.StopRequest) -> dict:
  main = jax.process_index() == 0
  mesh = meshlib.make_mesh(config.mesh)
  r, t = config.rollout, config.train
  specs = list(config.tasks.specs)
  model_cfg, params, tokenizer = load_model(config, workdir)
  stop_ids = sorted({tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids(s) for s in
                                               ("<|im_end|>", "<|eot_id|>") if s in
                                               tokenizer.get_vocab()})
  chat = agent.ChatFormat(tokenizer, stop_ids, config.tasks.system_prompt)
  mask = lora.trainable_mask(params, full_finetune=not config.model.lora_rank)
  trainable, frozen = lora.partition(params, mask)
  n_adapt, n_total = lora.count(params)
  log.info("model %s: %.2fM params, %s trainable; %d devices on %d hosts, mesh %s",
           model_cfg.architecture, n_total / 1e6,
           f"{n_adapt / 1e6:.2f}M (LoRA)" if n_adapt else "all", jax.device_count(),
           jax.process_count(), dict(mesh.shape))

  step_cfg = step_config(config, model_cfg, mesh)
  o = config.optim
  tx = make_optimizer(o.learning_rate, o.warmup_steps, o.weight_decay, o.grad_clip)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable,
                           opt_state=tx.init(trainable), pacing=pacing.init_pacing(len(specs)))
  state_sh = meshlib.shardings(state, mesh)
  state = meshlib.put(state, state_sh)
  frozen = meshlib.put(frozen, meshlib.shardings(frozen, mesh))
  sampler = TaskSampler(specs, list(config.tasks.weights) or None, seed=config.seed)
  run = Run(config, model_cfg, tokenizer, chat, frozen, specs, make_stepper(config), mesh)
  ckpt = Checkpointer(workdir / "checkpoints", t.checkpoint_keep)

  def save(state, logger):
    ckpt.save(int(meshlib.fetch(state.step)), state, {"sampler": sampler.state_dict(), "history": logger.history,
                                       "config": config.to_json()})

  history = []
  resumed, restored, meta = ckpt.restore_intact(state)
  if resumed is not None:
    state = restored
    sampler.load_state_dict(meta["sampler"])
    history = meta["history"]
    log.info("resumed from %s at RL step %d", ckpt.directory / str(resumed), int(state.step))
  logger = MetricsLogger(workdir, specs, t.num_steps, tensorboard=t.tensorboard, plots=t.plots,
                         wandb_project=t.wandb_project, wandb_config=config.to_dict(),
                         write=main, history=history)
  if resumed is None:
    if config.sft.enabled:
      state = state.replace(trainable=sft_stage(run, state.trainable, logger))
    save(state, logger)

  keys = named_keys(config.seed)
  rollout_key, train_key, eval_key = keys["rollout"], keys["train"], keys["eval"]
  update_fns = {}

  def update_fn(shared_prefix: int):
    """The jitted update for batches whose groups share their first `shared_prefix` tokens (one
    compilation per value; `steps.shared_prefix_length` rounds it to few values)."""
    if shared_prefix not in update_fns:
      update_fns[shared_prefix] = jit_update(step_cfg, tx, state_sh,
                                             meshlib.shardings(run.frozen, mesh), mesh,
                                             shared_prefix, r.group_size)
      if shared_prefix:
        log.info("update: each group's first %d tokens (its prompt) run once per group",
                 shared_prefix)
    return update_fns[shared_prefix]

  share_prompt = shares_prompt(config)
  host_instances = r.instances_per_step // jax.process_count()
  bad_steps = no_signal_steps = 0

  if int(meshlib.fetch(state.step)) == 0:  # Where RL starts from (after SFT).
    logger.log(0, *evaluate(run, state.trainable, eval_key, sampler))
  if signalled := parallel.global_max(signals.signum or 0):  # During SFT: its result is saved.
    logger.close()
    ckpt.close()
    raise interrupt.Interrupted(
        f"{interrupt.signal.Signals(signalled).name}: stopped before RL step "
        f"{int(meshlib.fetch(state.step)) + 1}; the checkpoint in {ckpt.directory} is up to date; rerun the "
        "same command to resume.", signalled)
  # A run resumed at its last step logs nothing new: its result is the last record it has.
  record = logger.history[-1] if logger.history else {}
  while (step := int(meshlib.fetch(state.step)) + 1) <= t.num_steps:
    start = time.time()
    drawn = sampler.sample(r.instances_per_step)
    mine = drawn[jax.process_index() * host_instances:(jax.process_index() + 1) * host_instances]
    instances = [agent.Instance(k, specs[k], seed) for k, seed in mine]
    run.stepper.seconds = 0.0
    policy = run.policy(state.trainable, jax.random.fold_in(rollout_key, step), greedy=False)
    episodes = run.play(policy, instances, r.group_size)
    env_s, play_s = run.stepper.seconds, time.time() - start
    steps.check_loss_budget(episodes.loss_mask, step_cfg.loss_tokens_per_row)
    arrays = batch_arrays(episodes, jax.process_index() * host_instances,
                          sampler=step_cfg.old_logprobs == "sampler")
    shared = 0
    if share_prompt:  # The shortest over hosts: one program for the global batch.
      shared = -parallel.global_max(-steps.shared_prefix_length(
          arrays["tokens"], arrays["attention_mask"], arrays["loss_mask"], r.group_size))
    batch = meshlib.put_rows(arrays, mesh)
    with jax.set_mesh(mesh):
      state, metrics = update_fn(shared)(state, run.frozen, batch,
                                         jax.random.fold_in(train_key, step))
    metrics = meshlib.fetch(metrics)
    total_s = time.time() - start
    all_episodes = agent.EpisodeBatch(**parallel.gather_hosts(dataclasses.asdict(episodes)))
    scalars, per_task = episode_metrics(all_episodes, len(specs))
    per_task.update({k[:-2]: v for k, v in metrics.items() if k.endswith("_K")})
    absent = metrics["token_count_K"] == 0  # Batch statistics of a task with no tokens: NaN, not 0.
    for key in ("entropy", "clip_frac_low", "clip_frac_high", "approx_kl", "pg_loss"):
      per_task[key] = np.where(absent, np.nan, per_task[key])
    per_task["clip_frac"] = per_task["clip_frac_low"] + per_task["clip_frac_high"]
    scalars.update({k: v for k, v in metrics.items() if not k.endswith("_K")})
    tokens = all_episodes.attention_mask.sum()
    scalars.update({"time/generation_s": play_s - env_s, "time/environment_s": env_s,
                    "time/update_s": total_s - play_s, "time/step_s": total_s,
                    "tokens_per_s": tokens / total_s})

    # A step whose every episode was left out (failed envs, non-finite rewards) learned nothing.
    empty = scalars["excluded_episodes"] == len(all_episodes.rewards)
    bad = metrics["skipped"] > 0 or metrics["nonfinite_entropy"] > 0 or empty
    bad_steps = bad_steps + 1 if bad else 0
    if empty:
      log.warning("step %d: every episode failed or had a non-finite reward; nothing learned", step)
    elif bad:
      log.warning("step %d: non-finite loss, gradient or entropy; update skipped", step)
    no_signal_steps = no_signal_steps + 1 if metrics["advantage_abs_mean"] == 0 and not empty else 0
    if no_signal_steps and no_signal_steps % _NO_SIGNAL_STEPS == 0:
      log.warning(
          "step %d: for %d steps every group's episodes got equal rewards, so the updates had no "
          "signal (success %.2f; %.1f invalid actions in %.1f turns per episode): the policy "
          "may have collapsed", step, no_signal_steps, scalars["success"],
          all_episodes.invalid_actions.mean(), all_episodes.turns.mean())
    if t.eval_every and step % t.eval_every == 0 or step == t.num_steps:
      eval_scalars, eval_per_task = evaluate(run, state.trainable, eval_key, sampler)
      scalars.update(eval_scalars)
      per_task.update(eval_per_task)
    record = logger.log(step, scalars, per_task)
    logger.progress(step, _summary(specs, per_task["success"]))
    stop = bad_steps >= t.max_bad_steps
    signalled = parallel.global_max(signals.signum or 0)  # Every host stops at the same step.
    if step % t.checkpoint_every == 0 or step == t.num_steps or stop or signalled:
      save(state, logger)
      logger.plot()
    if signalled and not stop and step < t.num_steps:
      logger.close()
      ckpt.close()
      name = interrupt.signal.Signals(signalled).name
      raise interrupt.Interrupted(
          f"{name}: stopped after RL step {step} of {t.num_steps} and saved a checkpoint in "
          f"{ckpt.directory}; rerun the same command to resume.", signalled)
    if stop:
      logger.close()
      raise FloatingPointError(
          f"{bad_steps} consecutive RL steps had no usable episodes, or a non-finite loss, "
          f"gradient or entropy (last: "
          f"step {step}); stopped. The checkpoint in {ckpt.directory} holds the last good "
          "parameters: lower config.optim.learning_rate or check the data, then rerun to resume.")

  final = state
  logger.plot()
  logger.close()
  if t.export_hf and t.num_steps:
    params = meshlib.fetch(lora.combine(final.trainable, run.frozen))  # Every host takes part.
    if main:
      out = hf.export_hf(params, model_cfg, workdir / "hf_export", tokenizer)
      log.info("exported the final policy to %s", out)
  ckpt.close()
  if main:
    (workdir / "final_metrics.json").write_text(json.dumps(record, indent=1))
  return record
