"""The run survives its failures: one run per workdir, damaged checkpoints, signals, hung envs."""

import errno
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import faulty_envs  # pylint: disable=unused-import  (registers the faulty tasks)
import orbax.checkpoint as ocp

from eppo_jax import checkpoint, interrupt, programs, train, workdir
from eppo_jax.checkpoint import Checkpointer, NoIntactCheckpoint
from pipeline_util import (ROOT, assert_trees_equal, compile_cache, read_records, smoke_config,
                           smoke_tiny_dir, state_like)

LEAN = {"train.tensorboard": False, "train.plots": False, "train.export_hf": False}


# ----------------------------------------------------------------------------------------------
# One run per workdir.


def test_rerun_with_another_config_is_refused_before_writing(tmp_path):
  """A changed method / learning rate / model size is refused, listing the fields; nothing in
  the workdir changes."""
  config = smoke_config(tmp_path / "no_model")
  workdir.claim(config, tmp_path / "run")
  before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
  info = json.loads(before["run_info.json"])
  assert info["packages"]["jax"] == jax.__version__ and info["device_count"] == jax.device_count()
  assert {"python", "platform", "machine", "device_kind", "start_time"} <= set(info)

  changed = smoke_config(tmp_path / "no_model", **{"method": "grpo",
                                                   "optim.learning_rate": 1e-2})
  with pytest.raises(workdir.WorkdirConflict) as error:
    train.train(changed, tmp_path / "run")
  message = str(error.value)
  assert "method: 'eppo' -> 'grpo'" in message and "optim.learning_rate: 0.0002 -> 0.01" in message
  assert "allow_config_change" in message
  bigger = smoke_config(tmp_path / "no_model", **{"model.tiny_hidden_size": 64})
  with pytest.raises(workdir.WorkdirConflict, match="model.tiny_hidden_size: 32 -> 64"):
    train.train(bigger, tmp_path / "run")
  assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before
  assert not (tmp_path / "no_model").exists()

  # Safe changes resume without the flag; the override accepts anything and records it.
  longer = smoke_config(tmp_path / "no_model", **{"train.num_steps": 10, "train.eval_every": 5})
  assert set(workdir.claim(longer, tmp_path / "run")) == {"train.num_steps", "train.eval_every"}
  changed.train.allow_config_change = True
  changes = workdir.claim(changed, tmp_path / "run")
  assert {"method", "optim.learning_rate"} <= set(changes)
  info = json.loads((tmp_path / "run" / "run_info.json").read_text())
  assert info["config_changes"]["method"] == ["eppo", "grpo"] and len(info["previous_starts"]) == 2
  stored = json.loads((tmp_path / "run" / "config.json").read_text())
  assert stored["method"] == "grpo"

  # A record made before a field existed (a newer eppo_jax added it) resumes; a change of a field
  # the record has is still refused.
  del stored["rollout"]["temperature"]
  (tmp_path / "run" / "config.json").write_text(json.dumps(stored))
  assert set(workdir.claim(changed, tmp_path / "run")) == {"rollout.temperature"}
  changed.train.allow_config_change = False
  changed.rollout.temperature = 0.5
  with pytest.raises(workdir.WorkdirConflict, match=r"rollout.temperature: 1.0 -> 0.5"):
    workdir.claim(changed, tmp_path / "run")
  # How the same model is computed (attention kernel and blocks) is a safe change.
  changed.rollout.temperature = 1.0
  changed.model.attention_impl, changed.model.attention_block_q = "dense", 128
  assert {"model.attention_impl", "model.attention_block_q"} <= set(
      workdir.claim(changed, tmp_path / "run"))


# ----------------------------------------------------------------------------------------------
# Checkpoints.


def _damage(step_dir):
  for path in step_dir.rglob("*"):
    if path.is_file() and "ocdbt.process_0" in str(path):
      path.write_bytes(path.read_bytes()[:10])


def test_damaged_latest_checkpoint_falls_back_in_one_line(tmp_path, caplog, capfd):
  """One warning naming the damaged checkpoint, no asyncio noise, the older one restored."""
  ckpt = Checkpointer(tmp_path / "ckpt", keep=3)
  state = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((3, 4), np.int32)}
  for step in (1, 2):
    ckpt.save(step, jax.tree_util.tree_map(lambda x, s=step: x * s, state), {"step": step})
  _damage(tmp_path / "ckpt" / "2")
  with caplog.at_level(logging.WARNING):
    step, restored, meta = ckpt.restore_intact(state)
  assert step == 1 and meta == {"step": 1}
  np.testing.assert_array_equal(restored["a"], state["a"])
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and str(tmp_path / "ckpt" / "2") in warnings[0], warnings
  assert "Event loop is closed" not in capfd.readouterr().err
  # The damaged one is set aside, so the next save (step 2 again) is the latest.
  assert ckpt.all_steps() == [1] and (tmp_path / "ckpt.unreadable" / "2").exists()
  ckpt.save(2, state, {"step": 2})
  assert ckpt.restore_intact(state)[0] == 2
  _damage(tmp_path / "ckpt" / "1")
  _damage(tmp_path / "ckpt" / "2")
  with pytest.raises(NoIntactCheckpoint, match="none of the checkpoints"):
    ckpt.restore_intact(state)


def _failing_reads(monkeypatch, error: Exception, times: int) -> list:
  """The first `times` reads of a checkpoint raise `error` (each read appends to the list)."""
  read, calls = ocp.CompositeCheckpointHandler.restore, []

  def restore(self, directory, *args, **kwargs):
    calls.append(directory.name)
    if len(calls) <= times:
      raise error
    return read(self, directory, *args, **kwargs)
  monkeypatch.setattr(ocp.CompositeCheckpointHandler, "restore", restore)
  monkeypatch.setattr(checkpoint, "_RETRY_S", 0.0)
  return calls


def _two_checkpoints(directory) -> tuple[Checkpointer, dict]:
  ckpt = Checkpointer(directory, keep=3)
  state = {"a": np.arange(10, dtype=np.float32)}
  for step in (1, 2):
    ckpt.save(step, jax.tree_util.tree_map(lambda x, s=step: x * s, state), {"step": step})
  return ckpt, state


def test_a_read_that_times_out_once_is_retried_not_set_aside(tmp_path, monkeypatch, caplog):
  ckpt, state = _two_checkpoints(tmp_path / "ckpt")
  calls = _failing_reads(monkeypatch, OSError(errno.ETIMEDOUT, "Connection timed out"), 1)
  with caplog.at_level(logging.WARNING):
    step, restored, meta = ckpt.restore_intact(state)
  assert step == 2 and meta == {"step": 2} and calls == ["2", "2"]
  np.testing.assert_array_equal(restored["a"], 2 * state["a"])
  assert "attempt 2 of 3" in caplog.text and "unreadable" not in caplog.text
  assert ckpt.all_steps() == [1, 2] and not (tmp_path / "ckpt.unreadable").exists()


def test_out_of_memory_on_every_read_stops_and_leaves_the_checkpoints(tmp_path, monkeypatch):
  """Memory is no damage: after 3 attempts the run stops; no checkpoint is set aside."""
  ckpt, state = _two_checkpoints(tmp_path / "ckpt")
  oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7.00GiB.")
  calls = _failing_reads(monkeypatch, oom, 99)
  with pytest.raises(checkpoint.CheckpointReadFailed, match=r"ckpt/2 could not be read in 3 "
                     r"attempts \(RuntimeError: RESOURCE_EXHAUSTED.*left in place"):
    ckpt.restore_intact(state)
  assert calls == ["2", "2", "2"]
  assert ckpt.all_steps() == [1, 2] and not (tmp_path / "ckpt.unreadable").exists()


@pytest.mark.parametrize("error, damaged", [
    (FileNotFoundError("checkpoint/2/state/manifest.ocdbt"), True),
    (ValueError("DATA_LOSS: Error reading local file \"d/1f3\": Unexpected end of file"), True),
    (ValueError("NOT_FOUND: Error opening \"zarr\" driver: Metadata at ... does not exist"), True),
    (OSError(errno.ECONNRESET, "Connection reset by peer"), False),
    (ValueError("UNAVAILABLE: HTTP response code: 503 with body: Service Unavailable"), False),
    (ValueError("DEADLINE_EXCEEDED: Timed out waiting for GCS"), False),
    (MemoryError(), False),
])
def test_damage_is_told_from_a_failure_to_read(error, damaged):
  assert (checkpoint.read_failure(error) == checkpoint._DAMAGED) == damaged


def test_run_resumes_from_the_newest_intact_checkpoint(smoke_tiny_dir, compile_cache, tmp_path,
                                                       caplog):
  """Latest checkpoint damaged: the run redoes the steps since the older one and ends exactly
  where an undisturbed run ends."""
  del compile_cache
  config = smoke_config(smoke_tiny_dir, **LEAN, **{"train.num_steps": 2, "train.eval_every": 0,
                                                   "train.checkpoint_every": 1})
  a, b = tmp_path / "a", tmp_path / "b"
  train.train(config, a)
  assert Checkpointer(a / "checkpoints").all_steps() == [1, 2]
  _damage(a / "checkpoints" / "2")
  with caplog.at_level(logging.WARNING):
    train.train(config, a)
  unreadable = [r for r in caplog.records if "unreadable" in r.getMessage()]
  assert len(unreadable) == 1 and str(a / "checkpoints" / "2") in unreadable[0].getMessage()
  train.train(config, b)
  like = state_like(config, a)
  assert_trees_equal(Checkpointer(a / "checkpoints").restore(like)[0],
                     Checkpointer(b / "checkpoints").restore(like)[0])


# ----------------------------------------------------------------------------------------------
# Signals.


def test_signal_finishes_the_step_saves_and_exits(smoke_tiny_dir, compile_cache, tmp_path):
  """SIGINT (Ctrl-C) mid-run: the step ends, a checkpoint is saved, the exit says so. SIGTERM,
  which the same handler takes, goes to one host of a pod in test_pod.py."""
  sig = signal.SIGINT
  run_dir = tmp_path / "run"
  proc = subprocess.Popen(
      [sys.executable, "run.py", "--config=configs/multitask.py:smoke", f"--workdir={run_dir}",
       f"--config.model.tiny_dir={smoke_tiny_dir}", "--config.sft.enabled=False",
       "--config.train.num_steps=200", "--config.train.eval_every=0",
       "--config.train.checkpoint_every=1000", "--config.train.plots=False",
       "--config.train.tensorboard=False"],
      cwd=ROOT, env=compile_cache, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
      metrics = run_dir / "metrics.jsonl"
      if metrics.exists() and any("loss" in r for r in read_records(run_dir)):
        break
      time.sleep(0.5)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
  assert proc.returncode == 128 + sig, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  last = max(r["step"] for r in read_records(run_dir) if "loss" in r)
  assert f"{signal.Signals(sig).name}: stopped after RL step {last} of 200" in out
  assert "rerun the same command to resume" in out
  assert Checkpointer(run_dir / "checkpoints").latest_step() == last < 200


def test_a_compilation_that_the_stop_signal_ended_is_retried(smoke_tiny_dir, tmp_path,
                                                             monkeypatch):
  """SIGTERM to the process group also ends XLA's compiler (ptxas on a GPU): the update of step
  2 fails to compile. It is compiled again, the step finishes and is saved without its due
  evaluation, and the run stops; the resumed run evaluates step 2 first, then goes on."""
  jit_update, calls = programs.jit_update, []

  def compile_ended_by_the_signal(*args, **kwargs):
    update = jit_update(*args, **kwargs)

    def call(*a, **k):
      calls.append(len(calls) + 1)
      if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
        raise jax.errors.JaxRuntimeError("INTERNAL: ptxas exited with non-zero error code 15")
      return update(*a, **k)
    return call

  monkeypatch.setattr(programs, "jit_update", compile_ended_by_the_signal)
  config = smoke_config(smoke_tiny_dir, **{
      "sft.enabled": False, "train.num_steps": 3, "train.eval_every": 2,
      "train.plots": False, "train.tensorboard": False, "train.export_hf": False})
  with pytest.raises(interrupt.Interrupted, match="SIGTERM: stopped after RL step 2 of 3"):
    train.train(config, tmp_path / "run")
  assert calls == [1, 2, 3]
  assert Checkpointer(tmp_path / "run" / "checkpoints").latest_step() == 2
  evaluated = lambda: [r["step"] for r in read_records(tmp_path / "run") if "eval_success" in r]
  assert evaluated() == [0]
  final = train.train(config, tmp_path / "run")
  assert evaluated() == [0, 2, 3] and final["step"] == 3 and "eval_success" in final


def test_a_stop_during_sft_ends_it_unsaved(smoke_tiny_dir, tmp_path, monkeypatch):
  """SIGINT during the warm start: SFT stops at its next step; nothing is saved (its optimizer
  state is not checkpointed), so the rerun starts it again."""
  jit_sft = programs.jit_sft

  def signal_at_the_second_step(*args, **kwargs):
    sft, calls = jit_sft(*args, **kwargs), []

    def call(*a, **k):
      calls.append(1)
      if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
      return sft(*a, **k)
    return call

  monkeypatch.setattr(programs, "jit_sft", signal_at_the_second_step)
  config = smoke_config(smoke_tiny_dir, **{"sft.steps": 5, "train.plots": False,
                                           "train.tensorboard": False})
  with pytest.raises(interrupt.Interrupted, match="SIGINT: stopped after SFT step 2 of 5, before "
                     "any checkpoint; rerun"):
    train.train(config, tmp_path / "run")
  assert Checkpointer(tmp_path / "run" / "checkpoints").latest_step() is None


def test_only_a_program_that_did_not_run_is_retried():
  """No stop pending, or a donated argument already consumed: the error stands."""
  failures = []

  def program(x):
    failures.append(1)
    raise jax.errors.JaxRuntimeError("INTERNAL: compilation failed")

  retried = interrupt.retry_if_stopping(program)
  with pytest.raises(jax.errors.JaxRuntimeError):
    retried(np.zeros(2))  # No StopRequest has a signal.
  assert len(failures) == 1
  with interrupt.StopRequest() as stop:
    stop.signum = signal.SIGTERM
    consumed = jax.device_put(np.zeros(2))
    consumed.delete()
    with pytest.raises(jax.errors.JaxRuntimeError):
      retried(consumed)
    assert len(failures) == 2
    with pytest.raises(jax.errors.JaxRuntimeError):
      retried(np.zeros(2))  # Retried once, then the error stands.
    assert len(failures) == 4


# ----------------------------------------------------------------------------------------------
# Hung environments through the trainer.


def test_training_on_a_hanging_task_goes_on_and_leaves_nothing_behind(smoke_tiny_dir,
                                                                      compile_cache, tmp_path):
  """A registered task whose step blocks forever, default env settings ("auto" -> processes):
  its episodes fail after the timeout, are left out and logged, and no worker or thread stays."""
  del compile_cache, smoke_tiny_dir
  # Its own tiny model: the hanging task's cut-short transcripts change the tokenizer corpus.
  config = smoke_config(tmp_path / "tiny", **LEAN, **{
      "tasks.specs": ("sokoban:easy", "alwayshang_test:easy"), "tasks.step_timeout_s": 1.0,
      "sft.enabled": False, "train.num_steps": 1, "train.eval_every": 0,
      "train.eval_instances_per_task": 1})
  assert config.tasks.env_backend == "auto" and config.tasks.env_workers == 0
  start = time.perf_counter()
  train.train(config, tmp_path / "run")
  elapsed = time.perf_counter() - start
  step = [r for r in read_records(tmp_path / "run") if "loss" in r][0]
  assert step["excluded_episodes"] >= step["env_failures"] > 0, step
  assert step["eval_env_failures"] == 1  # The hanging task's one evaluation episode.
  assert np.isfinite(step["loss"])
  assert not multiprocessing.active_children()
  assert all(t.daemon or t is threading.main_thread() for t in threading.enumerate()
             if t.name.startswith("env")), threading.enumerate()
  assert elapsed < 600


def test_unknown_override_is_one_line(tmp_path):
  """--config.train.foo=1: one line naming config.train.foo, no traceback, nothing written."""
  proc = subprocess.run(
      [sys.executable, "run.py", "--config=configs/multitask.py:smoke", "--config.train.foo=1",
       f"--workdir={tmp_path / 'run'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines() == [
      "error: --config.train.foo: the config has no field config.train.foo (\"'foo'\")"]
  assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# A run that cannot learn says so.


def test_steps_without_learning_signal_are_reported(compile_cache, tmp_path, caplog):
  """A task that scores every episode 0: every group's rewards are equal, the advantages and the
  gradient are 0, and after 5 such steps the run warns once, with what the episodes did."""
  del compile_cache
  # Its own tiny model: the task's one-turn transcripts change the tokenizer corpus.
  config = smoke_config(tmp_path / "tiny", **LEAN, **{
      "tasks.specs": ("flatlake_test:easy",), "sft.enabled": False, "train.num_steps": 6,
      "train.eval_every": 0, "train.eval_instances_per_task": 1})
  with caplog.at_level(logging.WARNING):
    train.train(config, tmp_path / "run")
  steps = [r for r in read_records(tmp_path / "run") if "loss" in r]
  assert [r["advantage_abs_mean"] for r in steps] == [0.0] * 6
  assert all(r["grad_norm"] == 0.0 and r["success"] == 0.0 for r in steps)
  warned = [r.getMessage() for r in caplog.records if "no signal" in r.getMessage()]
  assert len(warned) == 1 and warned[0].startswith("step 5: for 5 steps"), warned
  assert "success 0.00" in warned[0] and "in 1.0 turns per episode" in warned[0], warned
