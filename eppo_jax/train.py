"""The training run: a `Trainer` that sets up and restores, warms up with SFT, takes RL steps,
evaluates and saves, and closes.

One RL step: sample task instances -> play G episodes of each with the current policy (host
environments, device rollout) -> `steps.train_step` (pacing, advantages, PPO updates) on all
devices -> log; every few steps greedy evaluation on held-out seeds and a checkpoint.

Every device program comes from `eppo_jax.programs` and is `jax.jit` over the `config.mesh` device
mesh (`eppo_jax.mesh`): the params, adapters and optimizer state live sharded on it, batches enter
as global arrays split over data x fsdp (`eppo_jax.hosts` places them), and XLA inserts the
collectives.
"""

from __future__ import annotations

import dataclasses
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

from eppo_jax import (agent, config_check, gigpo, groups, hosts, interrupt, lora, metrics, programs,
                      steps, workdir as workdir_lib)
from eppo_jax.episodes import EpisodeBatch, PER_TURN_FIELDS, training_rewards
from eppo_jax import mesh as meshlib
from eppo_jax.checkpoint import (CheckpointReadFailed, Checkpointer, HostsDisagree,
                                 NoIntactCheckpoint)
from eppo_jax.envs import registry
from eppo_jax.envs.sampler import TaskSampler
from eppo_jax.metrics import MetricsLogger
from eppo_jax.models import hf, tiny
from eppo_jax.policy import ModelPolicy

_DEMO_SEED = 1_000_000  # First seed of the SFT demonstrations.
# The root key is split once into these purposes; per-step keys are `fold_in(key, step)`, so a
# resumed run draws the same numbers as an uninterrupted one.
_KEY_PURPOSES = ("rollout", "train", "eval", "lora")
# Consecutive steps in which every group's rewards were equal (all advantages 0) before the run
# warns: a policy that has collapsed to one outcome on every instance gets no gradient back out.
_NO_SIGNAL_STEPS = 5

log = logging.getLogger(__name__)


class TooManyBadSteps(FloatingPointError):
  """`train.max_bad_steps` consecutive RL steps learned nothing; the last good state is saved."""


# What ends a run with its message alone (run.py: "error: ..."), not a traceback: mistakes in
# the config or the workdir, and states of the checkpoints or the training that the message
# explains. Every host raises them at the same point (`hosts.stop_together`).
REPORTED_ERRORS = (config_check.ConfigError, workdir_lib.WorkdirConflict,
                   workdir_lib.WorkdirUnusable, HostsDisagree, NoIntactCheckpoint,
                   CheckpointReadFailed, TooManyBadSteps)


def named_keys(seed: int) -> dict:
  """{purpose: key} derived from the config seed."""
  root = jax.random.PRNGKey(seed)
  return {name: jax.random.fold_in(root, i) for i, name in enumerate(_KEY_PURPOSES)}


def tokenizer_corpus(specs, per_task: int = 40, stepper=None) -> list[str]:
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


def load_model(config, workdir: Path, mesh: Optional[jax.sharding.Mesh] = None):
  """(ModelConfig, params, tokenizer): the tiny model built locally, or an HF checkpoint, with
  the adapters `config.model` asks for. With `mesh`, each weight is read straight into its
  sharding on it (no host or chip ever holds the whole model)."""
  m = config.model
  if m.source == "tiny":
    spec = tiny.TinySpec(vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size,
                         intermediate_size=m.tiny_intermediate_size, num_layers=m.tiny_num_layers,
                         num_heads=m.tiny_num_heads, num_kv_heads=m.tiny_num_kv_heads,
                         seed=config.seed)
    kept = workdir_lib.as_path(m.tiny_dir or workdir_lib.tiny_model_dir(workdir))
    url = workdir_lib.url_scheme(kept) is not None  # Then each host reads a local copy.
    source = Path(workdir_lib.local_copy(kept) if url else kept)
    if jax.process_index() == 0:  # One builder; the other hosts read its build after the barrier.
      if url and (kept / tiny.STAMP).exists():  # A build from before: reused if it matches.
        workdir_lib.mirror(kept, source, tiny.STAMP)
      tiny.build_tiny_model(source, tokenizer_corpus(config.tasks.specs,
                                                     stepper=make_stepper(config)), spec)
      if url:
        workdir_lib.mirror(source, kept, tiny.STAMP)
    hosts.barrier("tiny_model")
    if url and jax.process_index() != 0:
      workdir_lib.mirror(kept, source, tiny.STAMP)
  else:
    try:  # A missing model is a one-line error at start-up (run.py), naming how to get it.
      source = hf.resolve_model_dir(m.source)
    except (FileNotFoundError, ValueError) as e:
      raise config_check.ConfigError(f"config.model.source: {e}") from e
  device = mesh.devices.flat[0] if mesh is not None else None
  pre = hf.load_pretrained(source, dtype=jnp.dtype(programs.model_dtype(m.dtype, device)),
                           param_dtype=jnp.dtype(programs.model_dtype(m.param_dtype, device)),
                           mesh=mesh)
  model_cfg, params = programs.model_config(config, pre.config, device), pre.params
  if lora_cfg := programs.lora_config(config):
    model_cfg, params = lora.add_lora(params, model_cfg, lora_cfg, named_keys(config.seed)["lora"])
  return model_cfg, params, pre.tokenizer


def stop_token_ids(tokenizer) -> list[int]:
  """End of a reply: EOS and the chat end-of-turn tokens the vocabulary has."""
  return sorted({tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids(s) for s in
                                           ("<|im_end|>", "<|eot_id|>") if s in
                                           tokenizer.get_vocab()})


def batch_arrays(episodes: EpisodeBatch, group_offset: int, keys: tuple[str, ...],
                 advantages=None, keep_rows=None) -> dict:
  """The train_step inputs `keys`, padded to a sequence length that every host agrees on.
  Episodes left out of the update carry a NaN reward (`episodes.training_rewards`), and so do the
  rows `keep_rows` leaves out; `advantages` [B,T] are host-computed per-token advantages."""
  arrays = {k: getattr(episodes, k) for k in keys if k != "advantages"}
  arrays["rewards"] = training_rewards(episodes)
  if keep_rows is not None:
    arrays["rewards"] = np.where(keep_rows, arrays["rewards"], np.nan).astype(np.float32)
  if advantages is not None:
    arrays["advantages"] = np.where(np.isfinite(arrays["rewards"])[:, None], advantages, 0.0)
  arrays["group_ids"] = arrays["group_ids"] + group_offset  # Globally unique over hosts.
  width = hosts.global_max(arrays["tokens"].shape[1])
  for key in arrays:
    if arrays[key].ndim == 2:
      arrays[key] = np.pad(arrays[key], ((0, 0), (0, width - arrays[key].shape[1])))
  return arrays


def gather_episodes(episodes: EpisodeBatch) -> EpisodeBatch:
  """Every host's episodes, for metrics (the per-turn records, read by this host's update only,
  stay behind)."""
  fields = dataclasses.asdict(episodes)
  for name in PER_TURN_FIELDS:
    fields.pop(name)
  return EpisodeBatch(**hosts.gather_hosts(fields))


def this_host(items: list) -> list:
  """This host's items of a list split over hosts (shares differ in size by one at most)."""
  return items[jax.process_index()::jax.process_count()]


def use_compilation_cache(directory: str) -> None:
  """Keeps compiled XLA programs in `directory` ("" = off), so a rerun, a resumed run or another
  run of the same shapes loads them instead of compiling again. A cache set before (the
  JAX_COMPILATION_CACHE_DIR variable, or `jax.config`) is left as it is."""
  if directory and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))


class Trainer:
  """One run of `config` in `workdir`: its state, programs, environments and logs.

  Phases: `setup` (model, state, programs, restore), `sft` (warm start), `rl_step` (one RL step),
  `evaluate_and_save` (evaluation, the log record, checkpoints, stop requests), `finish` (plots,
  export, final metrics) and `close`, which every exit path runs (`train` calls it in `finally`).
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: Path,
               signals: Optional[interrupt.StopRequest] = None):
    # Without a StopRequest that is entered, no signal ever arrives.
    self.config, self.workdir = config, workdir
    self.signals = signals or interrupt.StopRequest()
    self.specs = list(config.tasks.specs)
    self.logger, self.ckpt = None, None

  def setup(self) -> None:
    """Loads the model into its shardings, builds the state and programs, restores the newest
    intact checkpoint (if any) and opens the logs."""
    config, workdir = self.config, self.workdir
    try:
      self.mesh = meshlib.make_mesh(config.mesh)
    except ValueError as e:  # A mesh no layout of these hosts' devices can serve: one line.
      raise config_check.ConfigError(str(e)) from e
    self.model, params, self.tokenizer = load_model(config, workdir, self.mesh)
    self.chat = agent.ChatFormat(self.tokenizer, stop_token_ids(self.tokenizer),
                                 config.tasks.system_prompt)
    trainable, frozen = lora.partition(
        params, lora.trainable_mask(params, full_finetune=not config.model.lora_rank))
    n_adapt, n_total = lora.count(params)
    log.info("model %s: %.2fM params, %s trainable; %d devices on %d hosts, mesh %s",
             self.model.architecture, n_total / 1e6,
             f"{n_adapt / 1e6:.2f}M (LoRA)" if n_adapt else "all", jax.device_count(),
             jax.process_count(), dict(self.mesh.shape))
    self.step_cfg = programs.step_config(config, self.model, self.mesh)
    self.tx = programs.optimizer(config)
    state = programs.init_state(config, trainable, self.tx)
    self.state_sh = meshlib.shardings(state, self.mesh)
    self.frozen_sh = meshlib.shardings(frozen, self.mesh)
    self.state = hosts.put(state, self.state_sh)
    self.frozen = hosts.put(frozen, self.frozen_sh)
    self.sampler = TaskSampler(self.specs, list(config.tasks.weights) or None, seed=config.seed,
                               num_train_instances=config.tasks.train_instances or None)
    self.stepper = make_stepper(config)
    self.keys = named_keys(config.seed)
    self._updates = {}  # shared prefix length -> jitted update.
    self.bad_steps = self.no_signal_steps = 0
    self.ckpt = Checkpointer(workdir / "checkpoints", config.train.checkpoint_keep)
    t, history = config.train, []
    self.resumed, restored, meta = self.ckpt.restore_intact(self.state)
    # Whether the evaluation of the current step is still to be logged (a stop skipped it).
    self.eval_due, self._saved = False, None
    if self.resumed is not None:
      self.state = restored
      self.sampler.load_state_dict(meta["sampler"])
      history = meta["history"]
      self.eval_due = meta.get("eval_due", self.resumed == 0)
      self._saved = (self.resumed, self.eval_due)
      log.info("resumed from %s at RL step %d", self.ckpt.directory / str(self.resumed),
               self.step)
    self.logger = MetricsLogger(workdir, self.specs, t.num_steps, tensorboard=t.tensorboard,
                                plots=t.plots, wandb_project=t.wandb_project,
                                wandb_config=config.to_dict(), write=jax.process_index() == 0,
                                history=history)

  @property
  def step(self) -> int:
    """RL steps taken (0 before the first, and during SFT)."""
    return int(hosts.fetch(self.state.step))

  def save(self, sampler_state: Optional[dict] = None) -> None:
    """Checkpoints the current step; `sampler_state` replaces the sampler's current one (that
    of the step's start, when a stop abandons the step)."""
    self.ckpt.save(self.step, self.state, self.meta(sampler_state))
    self._saved = (self.step, self.eval_due)

  def meta(self, sampler_state: Optional[dict] = None) -> dict:
    """What a checkpoint keeps besides the arrays (JSON)."""
    return {"sampler": sampler_state or self.sampler.state_dict(), "history": self.logger.history,
            "eval_due": self.eval_due, "config": self.config.to_json()}

  # --------------------------------------------------------------------------------------------
  # Stopping on a signal.

  def agreed_stop(self) -> int:
    """The signal that any host received (0: none): every host gets the same answer."""
    return hosts.global_max(self._pending())

  def _pending(self) -> int:
    """This host's signal, for the episode loop's own agreement (`agent.collect_episodes`)."""
    return self.signals.signum or 0

  def stopped(self, signum: int, sampler_state: Optional[dict] = None) -> interrupt.Interrupted:
    """Saves the last completed RL step, unless the newest checkpoint holds it as it is now ->
    the exception that ends the run."""
    if self._saved != (self.step, self.eval_due):
      self.save(sampler_state)
      self.logger.plot()
    n = self.config.train.num_steps
    done = f"after RL step {self.step} of {n}" if self.step else f"before RL step 1 of {n}"
    return interrupt.Interrupted(
        f"{interrupt.signal.Signals(signum).name}: stopped {done} and saved a checkpoint in "
        f"{self.ckpt.directory}; rerun the same command to resume.", signum)

  # --------------------------------------------------------------------------------------------
  # Playing episodes.

  def policy(self, rng, greedy: bool, episode_offset: int = 0) -> ModelPolicy:
    """The model as an `agent.Policy`; this host's first episode has the global id
    `episode_offset` (see `ModelPolicy`)."""
    r = self.config.rollout
    sampling = programs.sampling_config(self.config, self.chat.stop_token_ids,
                                        self.tokenizer.pad_token_id, greedy)
    params = lora.combine(self.state.trainable, self.frozen)  # Dict surgery: no copy.
    return ModelPolicy(params, self.model, sampling, r.max_episode_tokens, rng, self.mesh,
                       prefill_chunk=r.prefill_chunk, episode_offset=episode_offset)

  def play(self, policy, instances, group_size: int) -> EpisodeBatch:
    r = self.config.rollout
    return agent.collect_episodes(
        policy, self.chat, registry.make, instances, group_size, max_turns=r.max_turns,
        max_new_tokens=r.max_new_tokens, max_slots=r.max_episode_tokens, stepper=self.stepper,
        pad_id=self.tokenizer.pad_token_id, stop=self._pending)

  def evaluate(self) -> tuple[dict, dict]:
    """Greedy episodes on each task's fixed held-out seeds -> (scalars, per-task arrays).

    Played a rollout batch at a time (instances_per_step x group_size episodes over all hosts):
    the KV cache and the policy's buffers are sized, and checked by the fit tool, for that
    batch, while eval_instances_per_task x tasks may be many times larger (128 x 2 episodes of
    2304 slots are a 25 GiB float32 KV cache for SmolLM2-135M)."""
    n, r = self.config.train.eval_instances_per_task, self.config.rollout
    instances = [agent.Instance(k, self.specs[k], seed)
                 for k, seed in self.sampler.eval_instances(n)]
    policy, chunk = self.policy(self.keys["eval"], greedy=True), r.instances_per_step * r.group_size
    played, start = [], time.time()
    # Every host plays the same number of chunks: each turn is one program over all hosts.
    for i in range(0, len(instances), chunk):
      played.append(self.play(policy, this_host(instances[i:i + chunk]), 1))
      if len(instances) > chunk:  # Long evaluations say how far they are.
        log.info("evaluation: %d of %d episodes in %.0fs", min(i + chunk, len(instances)),
                 len(instances), time.time() - start)
    episodes = groups.concat(played)
    return metrics.episode_metrics(gather_episodes(episodes), len(self.specs), "eval_")

  # --------------------------------------------------------------------------------------------
  # SFT.

  def demonstrations(self) -> EpisodeBatch:
    """Expert episodes for the SFT warm start (this host's share), on training-range seeds."""
    n, r = self.config.sft.demos_per_task, self.config.rollout
    instances = [agent.Instance(k, spec, _DEMO_SEED + i)
                 for k, spec in enumerate(self.specs) for i in range(n)]
    return agent.expert_episodes(
        self.chat, registry.make, this_host(instances),
        max_turns=r.max_turns, max_new_tokens=r.max_new_tokens, max_slots=r.max_episode_tokens,
        pad_id=self.tokenizer.pad_token_id, stepper=self.stepper, stop=self._pending)

  def sft(self) -> None:
    """Supervised warm start on expert demonstrations (assistant tokens only). A stop ends it
    unsaved: its optimizer state is not checkpointed, so a resumed run starts it again."""
    s = self.config.sft
    try:
      demos = self.demonstrations()
    except interrupt.StopNow as stopping:
      raise self.sft_stopped(stopping.signum, 0) from None
    usable = np.flatnonzero(~demos.failed)  # An env that failed mid-demonstration: not a demo.
    if not len(usable):
      raise RuntimeError("every expert demonstration failed (see the environment failures above)")
    log.info("SFT: %d demonstrations (%d failed, left out), %d tokens, %d trained", len(usable),
             len(demos.failed) - len(usable), demos.attention_mask[usable].sum(),
             demos.loss_mask[usable].sum())
    tx = programs.sft_optimizer(self.config)
    trainable = self.state.trainable
    opt_state = jax.jit(tx.init)(trainable)
    opt_sh = meshlib.shardings(opt_state, self.mesh)
    opt_state = hosts.put(opt_state, opt_sh)
    # The RL update's micro-batches split the SFT batch too: the same activation memory per chip.
    micro = self.config.optim.micro_batches
    sft = interrupt.retry_if_stopping(programs.jit_sft(
        self.model, tx, meshlib.shardings(trainable, self.mesh), opt_sh, self.frozen_sh, self.mesh,
        micro_batches=micro))
    rng = np.random.default_rng(self.config.seed)
    # Each micro-batch needs a row on every batch shard.
    unit = max(1, meshlib.batch_shards(self.mesh) // jax.process_count()) * micro
    per_host = max(unit, s.batch_size // jax.process_count())
    per_host -= per_host % unit
    arrays = {k: getattr(demos, k)[usable] for k in ("tokens", "attention_mask", "loss_mask")}
    start, loss = time.time(), float("nan")
    for i in range(s.steps):
      if signum := self.agreed_stop():
        raise self.sft_stopped(signum, i)
      pick = rng.choice(len(usable), per_host, replace=len(usable) < per_host)
      # Trim the batch to its longest demonstration (rounded up): fewer pad tokens, few shapes.
      # Every host's batch is as wide as the widest host's; narrower ones get zero columns.
      longest = int(arrays["attention_mask"][pick].sum(1).max()) + 1
      have = arrays["tokens"].shape[1]
      width = hosts.global_max(min(agent.round_up(longest, 64), have))
      batch = hosts.put_rows({k: np.pad(v[pick, :width], ((0, 0), (0, max(0, width - have))))
                              for k, v in arrays.items()}, self.mesh)
      with jax.set_mesh(self.mesh):  # Traced with the mesh in context: `mesh.constrain_rows`.
        trainable, opt_state, out = sft(trainable, opt_state, self.frozen, batch)
      if i % 5 == 0 or i == s.steps - 1:  # Reading the loss waits for the device: not every step.
        loss = float(hosts.fetch(out)["sft_loss"])
        self.logger.progress(i + 1, f"loss {loss:.3f}", phase="sft", total=s.steps)
        self.logger.log(-s.steps + i + 1, {"sft_loss": loss})
    self.logger.end_progress()
    log.info("SFT: %d steps in %.0fs, final loss %.4f", s.steps, time.time() - start, loss)
    self.state = self.state.replace(trainable=trainable)

  def sft_stopped(self, signum: int, steps_done: int) -> interrupt.Interrupted:
    self.logger.end_progress()
    return interrupt.Interrupted(
        f"{interrupt.signal.Signals(signum).name}: stopped after SFT step {steps_done} of "
        f"{self.config.sft.steps}, before any checkpoint; rerun the same command to start again.",
        signum)

  # --------------------------------------------------------------------------------------------
  # RL.

  def update_fn(self, shared_prefix: int):
    """The jitted update for batches whose groups share their first `shared_prefix` tokens (one
    compilation per value; `steps.shared_prefix_length` rounds it to few values)."""
    if shared_prefix not in self._updates:
      self._updates[shared_prefix] = interrupt.retry_if_stopping(programs.jit_update(
          self.step_cfg, self.tx, self.state_sh, self.frozen_sh, self.mesh, shared_prefix))
      if shared_prefix:
        log.info("update: each group's first %d tokens (its prompt) run once per group",
                 shared_prefix)
    return self._updates[shared_prefix]

  def play_step(self, step: int) -> tuple[EpisodeBatch, dict]:
    """This host's episodes for the update, with dynamic sampling from up to 1 + extra_rounds
    rounds of instances -> (episodes, zero-variance scalars and per-task arrays)."""
    r = self.config.rollout
    per_host = r.instances_per_step // jax.process_count()
    offset = jax.process_index() * per_host
    rounds, key = [], jax.random.fold_in(self.keys["rollout"], step)
    for i in range(1 + (r.extra_rounds if r.dynamic_sampling else 0)):
      drawn = self.sampler.sample(r.instances_per_step)[offset:offset + per_host]
      instances = [agent.Instance(k, self.specs[k], seed) for k, seed in drawn]
      # Episodes are instance-major, group_size per instance: ids are global over hosts.
      policy = self.policy(jax.random.fold_in(key, i) if i else key, greedy=False,
                           episode_offset=offset * r.group_size)
      rounds.append(self.play(policy, instances, r.group_size))
      played = groups.concat(rounds)
      # Another round only while some host lacks groups whose rewards differ (a global choice).
      if not r.dynamic_sampling or not hosts.global_max(
          per_host - int((~groups.zero_variance(played)).sum()) > 0):
        break
    episodes, shortfall = groups.select_groups(played, per_host)
    # [2, K] zero-variance and all groups per task, and the shortfall, summed over hosts.
    counts = np.concatenate([groups.per_task_zero_variance(played, len(self.specs)).ravel(),
                             [shortfall]])
    total = hosts.gather_hosts({"c": counts[None]})["c"].sum(0)
    zero_K, groups_K = total[:-1].reshape(2, -1)
    with np.errstate(invalid="ignore", divide="ignore"):
      per_task = {"zero_variance_groups": np.where(groups_K > 0, zero_K / groups_K, np.nan)}
    scalars = {"zero_variance_groups": zero_K.sum() / max(groups_K.sum(), 1)}
    if r.dynamic_sampling:
      scalars.update({"dynamic_sampling/rounds": len(rounds),
                      "dynamic_sampling/shortfall": total[-1]})
    return episodes, (scalars, per_task)

  def rl_step(self, step: int) -> tuple[dict, dict]:
    """Plays this step's episodes and updates the policy on them -> (scalars, per-task arrays)."""
    r, c, start = self.config.rollout, self.config, time.time()
    self.stepper.seconds = 0.0
    episodes, (group_scalars, group_per_task) = self.play_step(step)
    if signum := self.agreed_stop():  # Before the update, which may take long.
      raise interrupt.StopNow(signum)
    env_s, play_s = self.stepper.seconds, time.time() - start
    steps.check_loss_budget(episodes.loss_mask, self.step_cfg.loss_tokens_per_row)
    keep = groups.spread_filter(episodes, r.keep_groups) if r.keep_groups < 1 else None
    advantages = None
    if c.advantage_estimator == "gigpo":  # Whole groups are on this host: no gather needed.
      advantages = gigpo.token_advantages(episodes, gamma=c.gigpo.gamma, omega=c.gigpo.omega,
                                          step_normalize=c.gigpo.step_normalize)
    offset = jax.process_index() * (r.instances_per_step // jax.process_count())
    arrays = batch_arrays(episodes, offset, tuple(programs.batch_spec(c, self.step_cfg, 1)),
                          advantages, keep)
    shared = 0
    if c.optim.share_prompt:  # The shortest over hosts: one program for the batch.
      shared = -hosts.global_max(-steps.shared_prefix_length(
          arrays["tokens"], arrays["attention_mask"], arrays["loss_mask"], r.group_size))
    batch = hosts.put_rows(arrays, self.mesh)
    with jax.set_mesh(self.mesh):
      self.state, update = self.update_fn(shared)(
          self.state, self.frozen, batch, jax.random.fold_in(self.keys["train"], step))
    update = hosts.fetch(update)
    everyone = gather_episodes(episodes)
    scalars, per_task = metrics.step_metrics(everyone, update, len(self.specs), play_s, env_s,
                                             time.time() - start)
    scalars.update(group_scalars)
    per_task.update(group_per_task)
    self._watch(step, scalars, update, everyone)
    return scalars, per_task

  def _watch(self, step: int, scalars: dict, update: dict, episodes: EpisodeBatch) -> None:
    """Counts steps that learned nothing (`bad_steps` stops the run) and warns about them."""
    # A step whose every episode was left out (failed envs, non-finite rewards) learned nothing.
    empty = scalars["excluded_episodes"] == len(episodes.rewards)
    bad = update["skipped"] > 0 or update["nonfinite_entropy"] > 0 or empty
    self.bad_steps = self.bad_steps + 1 if bad else 0
    if empty:
      log.warning("step %d: every episode failed or had a non-finite reward; nothing learned", step)
    elif bad:
      log.warning("step %d: non-finite loss, gradient or entropy; update skipped", step)
    silent = update["advantage_abs_mean"] == 0 and not empty
    self.no_signal_steps = self.no_signal_steps + 1 if silent else 0
    if self.no_signal_steps and self.no_signal_steps % _NO_SIGNAL_STEPS == 0:
      log.warning(
          "step %d: for %d steps every group's episodes got equal rewards, so the updates had no "
          "signal (success %.2f; %.1f invalid actions in %.1f turns per episode): the policy "
          "may have collapsed", step, self.no_signal_steps, scalars["success"],
          episodes.invalid_actions.mean(), episodes.turns.mean())

  def evaluate_and_save(self, step: int, scalars: dict, per_task: dict) -> dict:
    """Evaluates when due, logs the step's record, saves when due, and stops the run (with a
    checkpoint) on a stop request or after too many bad steps -> the record. A stop skips or
    ends a due evaluation; the resumed run does it (`eval_due`)."""
    t = self.config.train
    due = bool(t.eval_every and step % t.eval_every == 0 or step == t.num_steps)
    signalled = self.agreed_stop()
    if due and not signalled:
      try:
        eval_scalars, eval_per_task = self.evaluate()
        scalars.update(eval_scalars)
        per_task.update(eval_per_task)
      except interrupt.StopNow as stopping:
        signalled = stopping.signum
    self.eval_due = due and bool(signalled)
    record = self.logger.log(step, scalars, per_task)
    self.logger.progress(step, metrics.progress_summary(self.specs, per_task["success"]))
    stop = self.bad_steps >= t.max_bad_steps
    if step % t.checkpoint_every == 0 or step == t.num_steps or stop or signalled:
      self.save()
      self.logger.plot()
    if signalled and not stop and (step < t.num_steps or self.eval_due):
      raise self.stopped(signalled)
    if stop:
      raise TooManyBadSteps(
          f"{self.bad_steps} consecutive RL steps had no usable episodes, or a non-finite loss, "
          f"gradient or entropy (last: step {step}); stopped. The checkpoint in "
          f"{self.ckpt.directory} holds the last good parameters: lower "
          "config.optim.learning_rate or check the data, then rerun to resume.")
    return record

  # --------------------------------------------------------------------------------------------
  # The whole run.

  def run(self) -> dict:
    """Set-up, SFT (on a fresh start), then RL steps until `train.num_steps` -> the last logged
    record."""
    self.setup()
    if self.resumed is None:
      if self.config.sft.enabled:
        self.sft()
      self.eval_due = True  # Where RL starts from (after SFT).
      self.save()
    if self.eval_due:
      try:
        if signum := self.agreed_stop():
          raise interrupt.StopNow(signum)
        self.logger.log(self.step, *self.evaluate())
      except interrupt.StopNow as stopping:
        raise self.stopped(stopping.signum) from None
      self.eval_due = False
      if self._saved == (self.step, True):
        # The checkpoint (saved before the evaluation, so that SFT survives a failure in it) now
        # records it as done: a run resumed from here (every arm of a study, a run extended
        # after `num_steps=0`) does not play it again.
        self.ckpt.update_meta(self.step, self.meta())
        self._saved = (self.step, False)
    # A run resumed at its last step logs nothing new: its result is its last step's records.
    record = {k: v for r in self.logger.history if r["step"] == self.step for k, v in r.items()}
    while (step := self.step + 1) <= self.config.train.num_steps:
      sampler_state = self.sampler.state_dict()
      try:
        scalars, per_task = self.rl_step(step)
      except interrupt.StopNow as stopping:  # The step's episodes are dropped, unused.
        raise self.stopped(stopping.signum, sampler_state) from None
      record = self.evaluate_and_save(step, scalars, per_task)
    self.finish(record)
    return record

  def finish(self, record: dict) -> None:
    """Plots, the HF export of the final policy and `final_metrics.json`."""
    self.logger.plot()
    if self.config.train.export_hf and self.config.train.num_steps:
      # Every host takes part (each gathers its shards); process 0 writes.
      out = hf.export_hf(lora.combine(self.state.trainable, self.frozen), self.model,
                         self.workdir / "hf_export", self.tokenizer)
      log.info("exported the final policy to %s", out)
    if jax.process_index() == 0:
      (self.workdir / "final_metrics.json").write_text(json.dumps(record, indent=1))

  def close(self) -> None:
    """Closes the logs and the checkpointer (waiting for a save in flight); idempotent."""
    if self.logger is not None:
      self.logger.close()
      self.logger = None
    if self.ckpt is not None:
      self.ckpt.close()
      self.ckpt = None


def train(config: ml_collections.ConfigDict, workdir) -> dict:
  """Runs (or resumes) the configured job in `workdir`; returns the last logged record.

  Raises `interrupt.Interrupted` after saving a checkpoint when SIGINT or SIGTERM arrives (on
  several hosts: on any one of them; every host saves the same step), and `REPORTED_ERRORS` on
  every host that raises one. On several hosts any other exception, or one of those raised by
  some hosts only, ends the process (status 1) with a line naming the host and the cause, so
  that every host stops (`hosts.stop_together`); on one host it propagates.
  """
  hosts.initialize(config.distributed)
  with hosts.stop_together(agreed=(interrupt.Interrupted,), together=REPORTED_ERRORS):
    config_check.validate(config)
    workdir_lib.claim(config, workdir, write=jax.process_index() == 0)
    use_compilation_cache(config.train.compilation_cache)
    with interrupt.StopRequest() as signals:
      trainer = Trainer(config, workdir_lib.as_path(workdir), signals)
      try:
        return trainer.run()
      finally:
        trainer.close()
