"""The trainer: run.py end to end, exact resume, 1 vs 4 devices, NaNs, config checks (several
hosts: test_pod.py)."""

import dataclasses
import functools
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import eppo_jax
from eppo_jax import config_check, hosts, objective, pacing, programs, steps, train
from eppo_jax.agent import Instance
from eppo_jax.metrics import episode_metrics
from eppo_jax import mesh as meshlib
from eppo_jax.checkpoint import Checkpointer
from eppo_jax.envs import FrozenLake, registry
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import init_params
# pylint: disable-next=unused-import
from pipeline_util import (ROOT, assert_trees_equal, compile_cache, read_records, smoke_config,
                           smoke_tiny_dir, state_like)

LEAN = {"train.tensorboard": False, "train.plots": False, "train.export_hf": False}


def _training_metrics(record: dict) -> dict:
  """A record without wall-clock values and evaluation results."""
  return {k: v for k, v in record.items()
          if not (k == "time" or k.startswith("time/") or k == "tokens_per_s" or "eval_" in k)}


# ----------------------------------------------------------------------------------------------
# run.py end to end.


def test_run_py_smoke_writes_metrics_plots_and_hf_export(smoke_tiny_dir, compile_cache, tmp_path):
  """`python run.py --config=configs/multitask.py:smoke` trains 3 steps and writes every output."""
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "run.py", "--config=configs/multitask.py:smoke", f"--workdir={workdir}",
       f"--config.model.tiny_dir={smoke_tiny_dir}"],
      cwd=ROOT, env=compile_cache, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  records = read_records(workdir)
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
  assert any(r["step"] == 0 and "eval_success" in r for r in records)  # Before RL starts.
  assert (workdir / "plots.png").stat().st_size > 0
  final = json.loads((workdir / "final_metrics.json").read_text())
  assert final["step"] == 3 and "eval_success" in final
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  assert (workdir / "hf_export" / "config.json").exists()
  model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "hf_export")
  tokenizer = transformers.AutoTokenizer.from_pretrained(workdir / "hf_export")
  ids = tokenizer("<action>up</action>", return_tensors="pt")["input_ids"]
  with torch.no_grad():
    assert torch.isfinite(model(input_ids=ids).logits).all()


# ----------------------------------------------------------------------------------------------
# Resume.


@pytest.fixture(scope="module")
def resume_runs(smoke_tiny_dir, compile_cache, tmp_path_factory):
  """A: 2 steps, then (after a partial checkpoint is left behind) resumed to 4; B: 4 at once."""
  del compile_cache
  root = tmp_path_factory.mktemp("resume")
  a, b = root / "a", root / "b"
  train.train(smoke_config(smoke_tiny_dir, **LEAN, **{"train.num_steps": 2}), a)
  before = read_records(a)
  # What a save killed half-way through step 3 leaves behind.
  (a / "checkpoints" / "3.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (a / "checkpoints" / "3.orbax-checkpoint-tmp" / "state" / "garbage").write_bytes(b"\x00" * 7)
  shutil.copytree(a / "checkpoints" / "2", a / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000")
  latest_with_partial = Checkpointer(a / "checkpoints").latest_step()
  config = smoke_config(smoke_tiny_dir, **LEAN, **{"train.num_steps": 4})
  train.train(config, a)
  train.train(config, b)
  return dict(a=a, b=b, config=config, before=before, latest_with_partial=latest_with_partial)


def test_resume_is_bit_exact(resume_runs):
  """2 steps + resume to 4 ends in the same params, optimizer and pacing state as 4 straight."""
  a, b, config = resume_runs["a"], resume_runs["b"], resume_runs["config"]
  like = state_like(config, a)
  ckpt_a, ckpt_b = Checkpointer(a / "checkpoints"), Checkpointer(b / "checkpoints")
  assert ckpt_a.latest_step() == ckpt_b.latest_step() == 4
  state_a, meta_a = ckpt_a.restore(like)
  state_b, meta_b = ckpt_b.restore(like)
  assert int(state_a.step) == int(state_b.step) == 4
  assert_trees_equal(state_a, state_b)
  assert meta_a["sampler"] == meta_b["sampler"]
  steps_a = {r["step"]: _training_metrics(r) for r in read_records(a) if "loss" in r}
  steps_b = {r["step"]: _training_metrics(r) for r in read_records(b) if "loss" in r}
  assert sorted(steps_a) == sorted(steps_b) == [1, 2, 3, 4]
  for step in steps_a:
    assert steps_a[step] == steps_b[step], f"step {step}"


def test_resume_skips_a_partial_checkpoint(resume_runs):
  """A leftover temporary checkpoint directory is ignored: resume uses the last complete one."""
  a = resume_runs["a"]
  assert resume_runs["latest_with_partial"] == 2
  # The records of steps <= 2 come back from the step-2 checkpoint untouched (same wall-clock
  # stamps): the second run continued the first instead of starting over.
  early = [r for r in read_records(a) if r["step"] <= 2]
  assert early == resume_runs["before"]
  assert [r["step"] for r in read_records(a) if "loss" in r] == [1, 2, 3, 4]


def test_a_warm_start_evaluated_once_is_not_evaluated_again_on_resume(
    smoke_tiny_dir, compile_cache, tmp_path, monkeypatch):
  """A run of 0 RL steps (a warm start and its evaluation) extended to 1 step plays the step-0
  evaluation once: its checkpoint, saved before the evaluation, records it as done."""
  del compile_cache
  overrides = {**LEAN, "sft.steps": 2, "train.eval_every": 0, "train.eval_instances_per_task": 1}
  played, evaluate = [], train.Trainer.evaluate
  monkeypatch.setattr(train.Trainer, "evaluate",
                      lambda trainer: played.append(trainer.step) or evaluate(trainer))
  train.train(smoke_config(smoke_tiny_dir, **overrides, **{"train.num_steps": 0}), tmp_path)
  _, meta = Checkpointer(tmp_path / "checkpoints").restore(
      state_like(smoke_config(smoke_tiny_dir, **overrides), tmp_path))
  assert not meta["eval_due"] and any("eval_success" in r for r in meta["history"])
  train.train(smoke_config(smoke_tiny_dir, **overrides, **{"train.num_steps": 1}), tmp_path)
  assert played == [0, 1]  # Not [0, 0, 1].
  evals = [r["step"] for r in read_records(tmp_path) if "eval_success" in r]
  assert evals == [0, 1]


# ----------------------------------------------------------------------------------------------
# train_step on 1 vs 4 devices, and non-finite batches.

D = 4
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)
B, T, K, G = 16, 24, 3, 2  # Global episodes, tokens, tasks, group size.


def _step_config(minibatches: int, **pacing_overrides) -> steps.StepConfig:
  pacing_cfg, loss_cfg = objective.method_configs("eppo", **pacing_overrides)
  return steps.StepConfig(model=MODEL, pacing=pacing_cfg, loss=loss_cfg, num_tasks=K,
                          num_groups=B // G, temperature=1.0, num_minibatches=minibatches)


@functools.lru_cache(maxsize=None)
def _train_fn(devices: int, minibatches: int, estimator: str = "grpo",
              entropy_tokens: str = "all"):
  """(host state, batch, key) -> host (state, metrics): train_step compiled as the trainer
  compiles it (`programs.jit_update`), on a data-parallel mesh of `devices` devices."""
  tx = programs.make_optimizer(3e-3, 0, 0.0, 1.0)
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY, jax.devices()[:devices])
  cfg = dataclasses.replace(_step_config(minibatches, entropy_tokens=entropy_tokens),
                            advantage_estimator=estimator,
                            minibatch_sharding=meshlib.minibatch_sharding(mesh))
  state_sh = meshlib.shardings(_initial_state(tx), mesh)
  update = programs.jit_update(cfg, tx, state_sh, {}, mesh)

  def fn(state, batch, key):
    state = hosts.put(jax.device_get(state), state_sh)  # A copy: the update donates its state.
    with jax.set_mesh(mesh):
      return hosts.fetch(update(state, {}, hosts.put_rows(batch, mesh), key))
  return fn, tx


def _initial_state(tx) -> steps.TrainState:
  params = init_params(MODEL, jax.random.PRNGKey(0))
  return steps.TrainState(step=np.zeros((), np.int32), trainable=params,
                          opt_state=tx.init(params), pacing=pacing.init_pacing(K))


def _batch(seed: int) -> dict:
  """Episodes of 3 tasks in groups of G (global group ids), ragged prompts and replies."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, MODEL.vocab_size, size=(B, T)).astype(np.int32)
  lengths = rng.integers(T // 2, T + 1, size=B)
  prompt = rng.integers(4, 10, size=B)
  pos = np.arange(T)[None]
  attention = pos < lengths[:, None]
  loss = attention & (pos >= prompt[:, None])
  loss[3, :] = False  # An episode that generated nothing.
  group_ids = np.repeat(np.arange(B // G), G).astype(np.int32)
  task_ids = np.array([0, 1, 2, 0, 1, 2, 1, 1], np.int32)[group_ids]
  rewards = rng.normal(size=B).astype(np.float32)
  rewards[2:4] = 0.5  # A group whose episodes all scored the same: zero advantage.
  return dict(tokens=tokens, attention_mask=attention, loss_mask=loss, task_ids=task_ids,
              group_ids=group_ids, rewards=rewards)


def test_train_step_is_the_same_on_1_and_4_devices():
  """One global batch through train_step on 1 and on 4 devices: same params and metrics, 3 steps
  (two minibatches, each split over the 4 devices)."""
  minibatches = 2
  results = {}
  for devices in (1, D):
    fn, tx = _train_fn(devices, minibatches)
    state, trace = _initial_state(tx), []
    for step in range(3):
      state, metrics = fn(state, _batch(step), jax.random.fold_in(jax.random.PRNGKey(1), step))
      trace.append((state, metrics))
    results[devices] = trace
  for step, ((s1, m1), (s4, m4)) in enumerate(zip(results[1], results[D])):
    assert m1["skipped"] == 0 and m1["advantage_abs_mean"] > 0
    for x, y in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s4)):
      np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5, err_msg=f"state, step {step}")
    for key in m1:
      np.testing.assert_allclose(m1[key], m4[key], atol=1e-5, rtol=1e-5, err_msg=key)
  # The params moved: equality is not that of two no-ops.
  first = jax.tree_util.tree_leaves(_initial_state(_train_fn(1, minibatches)[1]).trainable)
  last = jax.tree_util.tree_leaves(results[1][-1][0].trainable)
  assert max(float(np.abs(x - y).max()) for x, y in zip(first, last)) > 1e-3


def test_nonfinite_rewards_are_left_out_of_the_update():
  """NaN / inf reward rows carry no loss token and no weight: what they hold cannot change the
  update (bit for bit), while changing a healthy row does."""
  fn, tx = _train_fn(D, 2)
  state, key = _initial_state(tx), jax.random.PRNGKey(2)
  bad = _batch(1)
  bad["rewards"][[5, 9, 12]] = [np.nan, np.inf, -np.inf]
  new, metrics = fn(state, bad, key)
  assert (metrics["skipped"] == 0).all()
  healthy = np.isfinite(bad["rewards"])
  counted = np.bincount(bad["task_ids"], weights=(bad["loss_mask"][:, 1:] & healthy[:, None]).sum(1),
                        minlength=K)
  np.testing.assert_array_equal(metrics["token_count_K"], counted)
  valid = healthy.copy()
  ref = np_advantages(bad["rewards"], bad["group_ids"], valid)
  np.testing.assert_allclose(metrics["advantage_abs_mean"], np.abs(ref).mean(), rtol=1e-5)
  other = {k: v.copy() for k, v in bad.items()}
  rng = np.random.default_rng(7)
  other["tokens"][[5, 9, 12]] = rng.integers(1, MODEL.vocab_size, size=(3, T))
  other["rewards"][[5, 9, 12]] = [-np.inf, np.nan, np.nan]
  same, _ = fn(state, other, key)
  assert_trees_equal(same.trainable, new.trainable)
  control = {k: v.copy() for k, v in bad.items()}
  control["tokens"][6] = rng.integers(1, MODEL.vocab_size, size=T)
  changed, _ = fn(state, control, key)
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(changed.trainable),
                                                      jax.tree_util.tree_leaves(new.trainable)))


def test_token_advantages_reach_the_update():
  """Host-computed per-token advantages ("gigpo": batch key "advantages" [B,T]) drive the update:
  the GRPO advantages written per token give GRPO's update on 4 devices, and changing the
  advantage of one loss token changes it."""
  grpo, tx = _train_fn(D, 2)
  per_token, _ = _train_fn(D, 2, "gigpo")
  batch, key = _batch(0), jax.random.PRNGKey(4)
  state = _initial_state(tx)
  valid = np.isfinite(batch["rewards"])
  adv_B = np_advantages(batch["rewards"], batch["group_ids"], valid).astype(np.float32)
  tokens = {**batch, "advantages": np.where(batch["loss_mask"], adv_B[:, None], 0.0)}
  expected, expected_metrics = grpo(state, batch, key)
  got, got_metrics = per_token(state, tokens, key)
  for x, y in zip(jax.tree_util.tree_leaves(expected.trainable),
                  jax.tree_util.tree_leaves(got.trainable)):
    np.testing.assert_allclose(y, x, atol=1e-6, rtol=1e-5)
  np.testing.assert_allclose(got_metrics["pg_loss_K"], expected_metrics["pg_loss_K"], rtol=1e-5,
                             atol=1e-7)
  row = 6
  col = np.flatnonzero(batch["loss_mask"][row])[2]
  tokens["advantages"][row, col] += 5.0
  moved, _ = per_token(state, tokens, key)
  assert any(not np.allclose(x, y) for x, y in zip(jax.tree_util.tree_leaves(moved.trainable),
                                                   jax.tree_util.tree_leaves(got.trainable)))


def test_action_token_pacing_averages_the_entropy_of_action_tokens():
  """With `entropy_tokens="action"` each task's paced entropy is the mean entropy of the policy
  (NumPy, from the model's logits) over its action tokens alone, on 4 devices; a left-out
  episode's action tokens do not count."""
  fn, tx = _train_fn(D, 2, entropy_tokens="action")
  batch = _batch(3)
  rng = np.random.default_rng(11)
  batch["action_mask"] = batch["loss_mask"] & (rng.random((B, T)) < 0.3)
  batch["rewards"][9] = np.nan
  state = _initial_state(tx)
  _, metrics = fn(state, batch, jax.random.PRNGKey(5))
  z = np.asarray(eppo_jax.logits(state.trainable, MODEL, batch["tokens"], batch["attention_mask"]),
                 np.float64)[:, :-1]  # Position t scores token t + 1.
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  entropy_BxT = -(p * np.log(p)).sum(-1)
  counted_BxT = batch["action_mask"][:, 1:] & np.isfinite(batch["rewards"])[:, None]
  sums = np.bincount(batch["task_ids"], (entropy_BxT * counted_BxT).sum(1), minlength=K)
  counts = np.bincount(batch["task_ids"], counted_BxT.sum(1), minlength=K)
  assert (counts > 0).all() and counts.sum() < batch["loss_mask"].sum() / 2
  np.testing.assert_array_equal(metrics["token_count_K"], counts)
  np.testing.assert_allclose(metrics["entropy_K"], sums / counts, rtol=1e-4)


def test_nonfinite_gradient_skips_the_update():
  """A NaN weight gives NaN gradients: every minibatch's update is skipped and counted, and the
  params and optimizer state stay as they were (a control step with healthy weights moves them)."""
  fn, tx = _train_fn(1, 2)
  state, key, batch = _initial_state(tx), jax.random.PRNGKey(3), _batch(0)
  leaves, treedef = jax.tree_util.tree_flatten(state.trainable)
  poisoned = [np.array(x) for x in leaves]
  poisoned[-1].flat[0] = np.nan
  bad_state = state.replace(trainable=jax.tree_util.tree_unflatten(treedef, poisoned))
  new, metrics = fn(bad_state, batch, key)
  assert int(metrics["skipped"]) == 2
  assert not np.isfinite(metrics["grad_norm"])
  assert_trees_equal(new.trainable, jax.device_get(bad_state.trainable))
  assert_trees_equal(new.opt_state, jax.device_get(bad_state.opt_state))
  moved, control = fn(state, batch, key)
  assert int(control["skipped"]) == 0
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(moved.trainable),
                                                      jax.tree_util.tree_leaves(state.trainable)))


def np_advantages(rewards, groups, valid, eps=1e-6):
  """GRPO advantages over the valid members of each group (0 elsewhere), loop by loop."""
  out = np.zeros(len(rewards))
  for i, g in enumerate(groups):
    members = rewards[(groups == g) & valid].astype(np.float64)
    if valid[i] and len(members) >= 2 and not np.all(members == members[0]):
      out[i] = (rewards[i] - members.mean()) / (members.std(ddof=1) + eps)
  return out


def _numpy_advantages(rewards, group_ids, task_ids, estimator, per_task_std, eps=1e-6):
  """Group-relative advantages from their textbook definitions, one group at a time."""
  adv = np.zeros_like(rewards, np.float64)
  for g in np.unique(group_ids):
    rows = group_ids == g
    r = rewards[rows].astype(np.float64)
    if len(r) < 2 or r.max() == r.min():
      continue
    if estimator == "rloo":  # Each episode against the mean of the others.
      adv[rows] = [r[i] - np.delete(r, i).mean() for i in range(len(r))]
    elif estimator == "drgrpo":
      adv[rows] = r - r.mean()
    else:
      scale_rows = task_ids == task_ids[rows][0] if per_task_std else rows
      adv[rows] = (r - r.mean()) / (rewards[scale_rows].astype(np.float64).std(ddof=1) + eps)
  return adv


@pytest.mark.parametrize("estimator, per_task_std",
                         [("grpo", False), ("grpo", True), ("drgrpo", False), ("rloo", False)])
def test_config_advantage_estimator_reaches_the_update(tmp_path, estimator, per_task_std):
  """`config.advantage_estimator` / `config.per_task_std` change the advantages train_step uses."""
  config = smoke_config(tmp_path, **{"advantage_estimator": estimator,
                                     "per_task_std": per_task_std,
                                     "tasks.specs": ("sokoban:easy", "frozenlake:easy",
                                                     "countdown:easy"),  # K tasks, as _batch.
                                     "rollout.instances_per_step": B // G, "rollout.group_size": G})
  config_check.validate(config)
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY, jax.devices()[:1])
  cfg = programs.step_config(config, MODEL, mesh)
  assert (cfg.advantage_estimator, cfg.per_task_std) == (estimator, per_task_std)
  tx = programs.make_optimizer(3e-3, 0, 0.0, 1.0)
  state = _initial_state(tx)
  state_sh = meshlib.shardings(state, mesh)
  batch = _batch(0)
  with jax.set_mesh(mesh):
    _, metrics = programs.jit_update(cfg, tx, state_sh, {}, mesh)(
        hosts.put(state, state_sh), {}, hosts.put_rows(batch, mesh), jax.random.PRNGKey(1))
  expected = _numpy_advantages(batch["rewards"], batch["group_ids"], batch["task_ids"], estimator,
                               per_task_std)
  np.testing.assert_allclose(hosts.fetch(metrics["advantage_abs_mean"]), np.abs(expected).mean(),
                             rtol=1e-5)


class _NanLake(FrozenLake):
  """FrozenLake whose every step pays a NaN reward (a broken reward function)."""

  def step(self, action):
    observation, _, done, info = super().step(action)
    return observation, float("nan"), done, info


def test_loop_stops_after_max_bad_steps_with_a_usable_checkpoint(smoke_tiny_dir, compile_cache,
                                                                  tmp_path):
  """Steps whose every episode has a NaN reward (all left out) stop the run after
  max_bad_steps (FloatingPointError), with a usable checkpoint."""
  del compile_cache
  registry.register("nanlake_test", _NanLake, overwrite=True)
  config = smoke_config(smoke_tiny_dir, **LEAN, **{
      "tasks.specs": ("sokoban:easy", "nanlake_test:easy", "countdown:easy"),
      "tasks.weights": (0.0, 1.0, 0.0), "sft.enabled": False, "train.num_steps": 6,
      "train.max_bad_steps": 2, "train.eval_every": 0, "train.eval_instances_per_task": 1,
      "train.checkpoint_every": 10})
  with pytest.raises(FloatingPointError, match="2 consecutive RL steps"):
    train.train(config, tmp_path)
  ckpt = Checkpointer(tmp_path / "checkpoints")
  assert ckpt.latest_step() == 2
  like = state_like(config, tmp_path)
  stopped, meta = ckpt.restore(like)
  start, _ = ckpt.restore(like, step=0)
  assert int(stopped.step) == 2
  assert_trees_equal(stopped.trainable, start.trainable)  # Nothing was learned.
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(stopped))
  assert [r["excluded_episodes"] for r in meta["history"] if "loss" in r] == [8, 8]
  assert [r["nonfinite_rewards"] for r in meta["history"] if "loss" in r] == [8, 8]


def test_evaluation_is_played_a_rollout_batch_at_a_time(smoke_tiny_dir, compile_cache, tmp_path):
  """More evaluation episodes than a rollout batch are played in batches of at most its size (the
  cache the rollout is sized for), with the same greedy episodes and metrics as one batch of all."""
  del compile_cache
  config = smoke_config(smoke_tiny_dir, **LEAN, **{
      "sft.enabled": False, "train.num_steps": 0, "train.eval_instances_per_task": 3,
      "rollout.instances_per_step": 2, "rollout.group_size": 2})
  trainer = train.Trainer(config, tmp_path)
  trainer.setup()
  played, play = [], trainer.play
  trainer.play = lambda policy, instances, g: played.append(len(instances) * g) or play(
      policy, instances, g)
  try:
    scalars, per_task = trainer.evaluate()
    instances = [Instance(k, trainer.specs[k], seed)
                 for k, seed in trainer.sampler.eval_instances(3)]
    whole = play(trainer.policy(trainer.keys["eval"], greedy=True), instances, 1)
  finally:
    trainer.close()
  assert len(trainer.specs) == 2 and played == [4, 2]  # 2 tasks x 3 instances, 2 x 2 at a time.
  ref_scalars, ref_per_task = episode_metrics(whole, len(trainer.specs), "eval_")
  assert scalars == ref_scalars and set(per_task) == set(ref_per_task)
  for key, value in ref_per_task.items():
    np.testing.assert_array_equal(per_task[key], value, err_msg=key)


# ----------------------------------------------------------------------------------------------
# Config validation.

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


@pytest.mark.parametrize("steps_", [10, 37])
def test_sft_cosine_schedule_scales_adams_step_by_the_cosine(tmp_path, steps_):
  """With the same gradients, the cosine schedule's updates are the constant schedule's times
  0.5 (1 + cos(pi (t - w) / (T - w))) after the warm-up (Adam's moments do not see the rate),
  equal during it, and 0 at the last step."""
  warmup = max(1, steps_ // 10)
  txs = [programs.sft_optimizer(smoke_config(tmp_path, **{"sft.steps": steps_, "sft.schedule": s}))
         for s in ("constant", "cosine")]
  params = {"w": np.zeros(3, np.float32)}
  states = [tx.init(params) for tx in txs]
  grads = np.random.default_rng(0).normal(size=(steps_ + 1, 3)).astype(np.float32) * 1e-2
  for t in range(steps_ + 1):
    updates = []
    for i, tx in enumerate(txs):
      u, states[i] = tx.update({"w": grads[t]}, states[i], params)
      updates.append(np.asarray(u["w"]))
    if t < warmup:
      want = 1.0
    else:
      want = 0.5 * (1 + np.cos(np.pi * min(t - warmup, steps_ - warmup) / (steps_ - warmup)))
    np.testing.assert_allclose(updates[1], want * updates[0], rtol=1e-5, atol=1e-12)
  assert want == 0.0


@pytest.mark.parametrize("steps_", [1, 2])
def test_sft_cosine_schedule_of_one_or_two_steps_updates(tmp_path, steps_):
  """As few SFT steps as the warm-up itself (the smoke runs): a schedule, finite updates."""
  tx = programs.sft_optimizer(smoke_config(tmp_path, **{"sft.steps": steps_,
                                                        "sft.schedule": "cosine"}))
  params = {"w": np.zeros(3, np.float32)}
  state = tx.init(params)
  for _ in range(steps_ + 1):
    u, state = tx.update({"w": np.ones(3, np.float32)}, state, params)
    assert np.isfinite(np.asarray(u["w"])).all()


@pytest.mark.parametrize("overrides, field", [
    ({"method": "ppo2"}, "config.method"),
    ({"rollout.instances_per_step": 3}, "config.rollout.instances_per_step"),
    ({"optim.num_minibatches": 3}, "config.optim.num_minibatches"),
    ({"optim.micro_batches": 0}, "config.optim.micro_batches=0 must be >= 1"),
    ({"optim.micro_batches": 2}, "config.optim.micro_batches=2"),
    ({"tasks.specs": ("sokoban:easy", "chess:easy")}, "config.tasks.specs"),
    ({"tasks.specs": ("sokoban:impossible",)}, "config.tasks.specs"),
    ({"rollout.group_size": 1, "rollout.instances_per_step": 4}, "config.rollout.group_size"),
    ({"tasks.weights": (1.0, 2.0, 3.0)}, "config.tasks.weights"),
    ({"advantage_estimator": "ppo"}, "config.advantage_estimator"),
    ({"advantage_estimator": "rloo", "per_task_std": True}, "config.per_task_std"),
    ({"optim.learning_rate": -1e-3}, "config.optim.learning_rate=-0.001 must be > 0"),
    ({"sft.learning_rate": float("nan")}, "config.sft.learning_rate=nan"),
    ({"sft.schedule": "linear"}, "config.sft.schedule"),
    ({"train.checkpoint_every": 0}, "config.train.checkpoint_every=0 must be >= 1"),
    ({"rollout.temperature": 0.0}, "config.rollout.temperature=0.0 must be > 0"),
    ({"rollout.top_p": 1.5}, "config.rollout.top_p"),
    ({"tasks.step_timeout_s": 0.0}, "config.tasks.step_timeout_s"),
    ({"tasks.train_instances": -1}, "config.tasks.train_instances"),
    ({"tasks.env_backend": "gpu"}, "config.tasks.env_backend"),
    ({"model.dtype": "float8"}, "config.model.dtype"),
    ({"train.max_bad_steps": 0}, "config.train.max_bad_steps"),
])
def test_bad_config_fails_before_compiling(tmp_path, overrides, field):
  """A bad config raises ValueError naming the field, before any model is built or compiled."""
  config = smoke_config(tmp_path / "no_model", **overrides)
  before = len(_compiles)
  with pytest.raises(ValueError) as error:
    train.train(config, tmp_path / "run")
  assert field in str(error.value)
  assert len(_compiles) == before
  assert not (tmp_path / "no_model").exists() and not (tmp_path / "run").exists()
