"""The training run: model setup, SFT warm start, the RL loop, evaluation, checkpoints and logs.

One RL step: sample task instances -> play G episodes of each with the current policy (host
environments, device `rollout`) -> `steps.train_step` (pacing, advantages, PPO updates) on all
devices -> log; every few steps greedy evaluation on held-out seeds and a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from eppo_jax import agent, lora, objective, pacing, parallel, steps
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

log = logging.getLogger(__name__)


def named_keys(seed: int) -> dict:
  """{purpose: key} derived from the config seed."""
  root = jax.random.PRNGKey(seed)
  return {name: jax.random.fold_in(root, i) for i, name in enumerate(_KEY_PURPOSES)}


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a bad config before anything is built or compiled, naming the field."""
  if config.method not in objective.METHODS:
    raise ValueError(f"config.method={config.method!r} is unknown; valid: {objective.METHODS}")
  objective.method_configs(config.method, **dict(config.pacing.overrides),
                           **dict(config.loss.overrides))
  if config.tasks.system_prompt not in agent.SYSTEM_PROMPTS:
    raise ValueError(f"config.tasks.system_prompt={config.tasks.system_prompt!r}; valid: "
                     f"{agent.SYSTEM_PROMPTS}")
  if not config.tasks.specs:
    raise ValueError("config.tasks.specs is empty")
  for spec in config.tasks.specs:
    try:
      registry.make(spec).close()  # Unknown task or level -> an error that lists the valid ones.
    except (KeyError, ValueError) as e:
      raise ValueError(f"config.tasks.specs: {e}") from e
  if config.tasks.weights and len(config.tasks.weights) != len(config.tasks.specs):
    raise ValueError(f"config.tasks.weights has {len(config.tasks.weights)} entries for "
                     f"{len(config.tasks.specs)} tasks")
  r = config.rollout
  if r.group_size < 2:
    raise ValueError(f"config.rollout.group_size={r.group_size}: group advantages need >= 2")
  episodes = r.instances_per_step * r.group_size
  if episodes % jax.device_count():
    raise ValueError(f"config.rollout.instances_per_step x group_size = {episodes} episodes is not "
                     f"divisible by the {jax.device_count()} devices")
  if r.instances_per_step % jax.process_count():
    raise ValueError(f"config.rollout.instances_per_step={r.instances_per_step} does not split "
                     f"over {jax.process_count()} hosts")
  per_device = episodes // jax.device_count()
  if per_device % config.optim.num_minibatches:
    raise ValueError(f"{per_device} episodes per device are not divisible by "
                     f"config.optim.num_minibatches={config.optim.num_minibatches}")
  if config.loss.overrides.get("kl_coef", 0.0) and not config.model.lora_rank:
    raise ValueError("config.loss.overrides.kl_coef needs LoRA (config.model.lora_rank > 0): the "
                     "KL reference is the base model with the adapters switched off")
  if r.max_new_tokens + 32 > r.max_episode_tokens:
    raise ValueError("config.rollout.max_episode_tokens leaves no room for a prompt")
  if config.optim.old_logprobs not in steps.OLD_LOGPROBS:
    raise ValueError(f"config.optim.old_logprobs={config.optim.old_logprobs!r}; valid: "
                     f"{steps.OLD_LOGPROBS}")
  if config.train.num_steps < 0 or config.optim.ppo_epochs < 1:
    raise ValueError("config.train.num_steps must be >= 0 and config.optim.ppo_epochs >= 1")


def _tokenizer_corpus(specs, per_task: int = 40) -> list[str]:
  """Texts the tiny tokenizer is trained on: instructions, observations and expert replies."""
  corpus = []
  for spec in specs:
    for seed in range(per_task):
      env = registry.make(spec)
      observation, _ = env.reset(10_000 + seed)
      corpus += [env.instructions, f"Task: {env.task_name}", observation]
      for action in env.solve():
        corpus.append(agent.format_action(action))
        observation, _, done, _ = env.step(action)
        corpus.append(observation)
        if done:
          break
      env.close()
  return corpus


def load_model(config, workdir: Path):
  """(ModelConfig, params, tokenizer): the tiny model built locally, or an HF checkpoint."""
  m = config.model
  if m.source == "tiny":
    spec = tiny.TinySpec(vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size,
                         intermediate_size=m.tiny_intermediate_size, num_layers=m.tiny_num_layers,
                         num_heads=m.tiny_num_heads, num_kv_heads=m.tiny_num_kv_heads,
                         seed=config.seed)
    directory = Path(m.tiny_dir or workdir / "tiny_model")
    if jax.process_index() == 0:  # One writer; the other hosts read it after the barrier.
      tiny.build_tiny_model(directory, _tokenizer_corpus(config.tasks.specs), spec)
    parallel.barrier("tiny_model")
    source = directory
  else:
    source = m.source
  pre = hf.load_pretrained(source, dtype=jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype))
  model_cfg = pre.config.replace(remat=m.remat)
  params = pre.params
  if m.lora_rank:
    lora_cfg = LoraConfig(rank=m.lora_rank, alpha=m.lora_alpha, targets=tuple(m.lora_targets))
    model_cfg, params = lora.add_lora(params, model_cfg, lora_cfg, named_keys(config.seed)["lora"])
  return model_cfg, params, pre.tokenizer


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
  frozen: object  # Replicated non-trainable params.
  task_names: list
  stepper: agent.EnvStepper

  def policy(self, trainable, rng, greedy: bool) -> ModelPolicy:
    r = self.config.rollout
    sampling = SamplingConfig(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        greedy=greedy, stop_token_ids=self.chat.stop_token_ids,
        pad_id=self.tokenizer.pad_token_id)
    params = lora.combine(trainable, self.frozen)  # Dict surgery on device arrays: no copy.
    return ModelPolicy(params, self.model, sampling, r.max_episode_tokens, rng)

  def play(self, policy, instances, group_size: int) -> agent.EpisodeBatch:
    r = self.config.rollout
    return agent.collect_episodes(
        policy, self.chat, registry.make, instances, group_size, max_turns=r.max_turns,
        max_new_tokens=r.max_new_tokens, max_slots=r.max_episode_tokens, stepper=self.stepper,
        pad_id=self.tokenizer.pad_token_id)


def _per_task(values: np.ndarray, task_ids: np.ndarray, num_tasks: int) -> np.ndarray:
  """Mean of `values` per task ([K], NaN for tasks absent from the batch)."""
  sums = np.bincount(task_ids, weights=values.astype(np.float64), minlength=num_tasks)
  counts = np.bincount(task_ids, minlength=num_tasks)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / counts, np.nan)


def episode_metrics(episodes: agent.EpisodeBatch, num_tasks: int, prefix: str = "") -> tuple:
  """(global scalars, per-task arrays) of a batch of episodes."""
  per_task = {
      f"{prefix}success": _per_task(episodes.success, episodes.task_ids, num_tasks),
      f"{prefix}reward": _per_task(episodes.rewards, episodes.task_ids, num_tasks),
      f"{prefix}invalid_actions": _per_task(episodes.invalid_actions, episodes.task_ids,
                                            num_tasks),
      f"{prefix}turns": _per_task(episodes.turns, episodes.task_ids, num_tasks),
      f"{prefix}episode_tokens": _per_task(episodes.num_tokens, episodes.task_ids, num_tasks),
  }
  scalars = {
      f"{prefix}success": episodes.success.mean(),
      f"{prefix}reward": episodes.rewards.mean(),
      f"{prefix}env_failures": episodes.failed.sum(),
      f"{prefix}truncated": episodes.truncated.mean(),
      f"{prefix}response_tokens": episodes.loss_mask.sum(1).mean(),
  }
  return scalars, per_task


def batch_arrays(episodes: agent.EpisodeBatch, group_offset: int, sampler: bool = False) -> dict:
  """The train_step inputs, padded to a sequence length that every host agrees on."""
  arrays = {k: getattr(episodes, k) for k in _BATCH_KEYS + (_SAMPLER_KEYS if sampler else ())}
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
                               max_slots=r.max_episode_tokens, pad_id=run.tokenizer.pad_token_id)


def sft_stage(run: Run, trainable, logger: MetricsLogger):
  """Supervised warm start on expert demonstrations (assistant tokens only) -> trainable."""
  s = run.config.sft
  demos = demonstrations(run)
  log.info("SFT: %d demonstrations, %d tokens, %d trained", len(demos.rewards),
           demos.attention_mask.sum(), demos.loss_mask.sum())
  tx = make_optimizer(s.learning_rate, max(1, s.steps // 10), 0.0, 1.0)
  sft = jax.pmap(functools.partial(steps.sft_step, model=run.model, tx=tx, axis_name=parallel.AXIS),
                 axis_name=parallel.AXIS, donate_argnums=(0, 1))
  trainable = parallel.replicate(trainable)
  opt_state = parallel.replicate(tx.init(parallel.unreplicate(trainable)))
  rng = np.random.default_rng(run.config.seed)
  per_host = max(jax.local_device_count(), s.batch_size // jax.process_count())
  per_host -= per_host % jax.local_device_count()
  arrays = {k: getattr(demos, k) for k in ("tokens", "attention_mask", "loss_mask")}
  start = time.time()
  for i in range(s.steps):
    pick = rng.choice(len(demos.rewards), per_host, replace=len(demos.rewards) < per_host)
    # Trim the batch to its longest demonstration (bucketed): fewer pad tokens, few shapes.
    width = parallel.global_max(agent.bucket(int(demos.attention_mask[pick].sum(1).max()) + 1, 64))
    batch = parallel.shard({k: v[pick, :width] for k, v in arrays.items()})
    trainable, opt_state, metrics = sft(trainable, opt_state, run.frozen, batch)
    if i % 25 == 0 or i == s.steps - 1:
      loss = float(parallel.unreplicate(metrics)["sft_loss"])
      log.info("SFT step %d/%d: loss %.4f (%.0fs)", i + 1, s.steps, loss, time.time() - start)
      logger.log(-s.steps + i + 1, {"sft_loss": loss})
  return parallel.unreplicate(trainable)


def _summary(names, success) -> str:
  """Live per-task success for the progress bar ("-" for a task absent from this batch)."""
  return " ".join(f"{n.split(':')[0][:6]} " + ("-" if np.isnan(s) else f"{s:.2f}")
                  for n, s in zip(names, success))


def train(config: ml_collections.ConfigDict, workdir) -> dict:
  """Runs (or resumes) the configured job in `workdir`; returns the last logged record."""
  parallel.initialize(config.distributed)
  validate(config)
  workdir = Path(workdir)
  main = jax.process_index() == 0
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
  log.info("model %s: %.2fM params, %s trainable; %d devices on %d hosts",
           model_cfg.architecture, n_total / 1e6,
           f"{n_adapt / 1e6:.2f}M (LoRA)" if n_adapt else "all", jax.device_count(),
           jax.process_count())

  pacing_cfg, loss_cfg = objective.method_configs(
      config.method, **dict(config.pacing.overrides), **dict(config.loss.overrides))
  step_cfg = steps.StepConfig(model=model_cfg, pacing=pacing_cfg, loss=loss_cfg,
                              num_tasks=len(specs), num_groups=r.instances_per_step,
                              temperature=r.temperature, ppo_epochs=config.optim.ppo_epochs,
                              num_minibatches=config.optim.num_minibatches,
                              # A reply has at most max_new_tokens loss tokens per turn.
                              loss_tokens_per_row=agent.bucket(r.max_turns * r.max_new_tokens, 32),
                              old_logprobs=config.optim.old_logprobs)
  o = config.optim
  tx = make_optimizer(o.learning_rate, o.warmup_steps, o.weight_decay, o.grad_clip)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable,
                           opt_state=tx.init(trainable), pacing=pacing.init_pacing(len(specs)))
  sampler = TaskSampler(specs, list(config.tasks.weights) or None, seed=config.seed)
  run = Run(config, model_cfg, tokenizer, chat, parallel.replicate(frozen), specs,
            agent.EnvStepper(config.tasks.env_workers, config.tasks.step_timeout_s))
  ckpt = Checkpointer(workdir / "checkpoints", t.checkpoint_keep)

  def save(state, logger):
    ckpt.save(int(state.step), state, {"sampler": sampler.state_dict(), "history": logger.history,
                                       "config": config.to_json()})

  history = []
  if ckpt.latest_step() is not None:
    state, meta = ckpt.restore(state)
    sampler.load_state_dict(meta["sampler"])
    history = meta["history"]
    log.info("resumed from %s at RL step %d", ckpt.directory, int(state.step))
  logger = MetricsLogger(workdir, specs, t.num_steps, tensorboard=t.tensorboard, plots=t.plots,
                         write=main, history=history)
  if ckpt.latest_step() is None:
    if config.sft.enabled:
      state = state.replace(trainable=sft_stage(run, state.trainable, logger))
    save(state, logger)

  keys = named_keys(config.seed)
  rollout_key, train_key, eval_key = keys["rollout"], keys["train"], keys["eval"]
  p_train = jax.pmap(functools.partial(steps.train_step, cfg=step_cfg, tx=tx),
                     axis_name=parallel.AXIS, donate_argnums=(0,))
  host_instances = parallel.host_share(r.instances_per_step * r.group_size, "episodes per step")
  host_instances //= r.group_size
  state = parallel.replicate(state)
  bad_steps = 0

  if int(parallel.unreplicate(state).step) == 0:  # Where RL starts from (after SFT).
    logger.log(0, *evaluate(run, state.trainable, eval_key, sampler))
  # A run resumed at its last step logs nothing new: its result is the last record it has.
  record = logger.history[-1] if logger.history else {}
  while (step := int(state.step[0]) + 1) <= t.num_steps:
    start = time.time()
    drawn = sampler.sample(r.instances_per_step)
    mine = drawn[jax.process_index() * host_instances:(jax.process_index() + 1) * host_instances]
    instances = [agent.Instance(k, specs[k], seed) for k, seed in mine]
    run.stepper.seconds = 0.0
    policy = run.policy(state.trainable, jax.random.fold_in(rollout_key, step), greedy=False)
    episodes = run.play(policy, instances, r.group_size)
    env_s, play_s = run.stepper.seconds, time.time() - start
    steps.check_loss_budget(episodes.loss_mask, step_cfg.loss_tokens_per_row)
    batch = parallel.shard(batch_arrays(episodes, jax.process_index() * host_instances,
                                        sampler=step_cfg.old_logprobs == "sampler"))
    step_keys = parallel.replicate(jax.random.fold_in(train_key, step))
    state, metrics = p_train(state, run.frozen, batch, step_keys)
    metrics = jax.device_get(parallel.unreplicate(metrics))
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

    bad = metrics["skipped"] > 0 or metrics["nonfinite_entropy"] > 0
    bad_steps = bad_steps + 1 if bad else 0
    if bad:
      log.warning("step %d: non-finite loss, gradient or entropy; update skipped", step)
    if t.eval_every and step % t.eval_every == 0 or step == t.num_steps:
      eval_scalars, eval_per_task = evaluate(run, state.trainable, eval_key, sampler)
      scalars.update(eval_scalars)
      per_task.update(eval_per_task)
    record = logger.log(step, scalars, per_task)
    logger.progress(step, _summary(specs, per_task["success"]))
    stop = bad_steps >= t.max_bad_steps
    if step % t.checkpoint_every == 0 or step == t.num_steps or stop:
      save(parallel.unreplicate(state), logger)
      logger.plot()
    if stop:
      logger.close()
      raise FloatingPointError(
          f"{bad_steps} consecutive RL steps had a non-finite loss, gradient or entropy (last: "
          f"step {step}); stopped. The checkpoint in {ckpt.directory} holds the last good "
          "parameters: lower config.optim.learning_rate or check the data, then rerun to resume.")

  final = parallel.unreplicate(state)
  logger.plot()
  logger.close()
  if main and t.export_hf and t.num_steps:
    params = jax.device_get(lora.combine(final.trainable, parallel.unreplicate(run.frozen)))
    out = hf.export_hf(params, model_cfg, workdir / "hf_export", tokenizer)
    log.info("exported the final policy to %s", out)
  ckpt.close()
  if main:
    (workdir / "final_metrics.json").write_text(json.dumps(record, indent=1))
  return record
