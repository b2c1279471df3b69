"""Environment backends: a hung, spinning or crashing env fails only its own episode, promptly."""

import multiprocessing
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import faulty_envs
from eppo_jax import agent, config_check
from eppo_jax.episodes import EpisodeBatch, training_rewards
from eppo_jax.envs import FrozenLake, registry
from eppo_jax.models import hf
from pipeline_util import ROOT, smoke_config, smoke_tiny_dir  # pylint: disable=unused-import

SEEDS = [1, 5, 2, 6, 3, 7, 4]  # 5, 6, 7 misbehave on their second step.
LOOP = dict(max_turns=64, max_new_tokens=64, max_slots=1 << 20)
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def chat(smoke_tiny_dir):
  tok = hf.load_tokenizer(smoke_tiny_dir)
  return agent.ChatFormat(tok, [tok.convert_tokens_to_ids("<|im_end|>")])


def _expert_actions(seeds):
  actions = []
  for seed in seeds:
    env = registry.make("frozenlake:easy")
    env.reset(seed)
    actions.append(env.solve())
  return actions


def _play(chat, spec, stepper=None):
  instances = [agent.Instance(0, spec, s) for s in SEEDS]
  policy = agent.ScriptedPolicy(chat, _expert_actions(SEEDS), 64)
  return agent.collect_episodes(policy, chat, registry.make, instances, 1, stepper=stepper,
                                **LOOP)


@pytest.fixture(scope="module")
def clean(chat):
  batch = _play(chat, "frozenlake:easy")
  assert all(len(a) >= 2 for a in _expert_actions(SEEDS)), "bad seeds must reach a second step"
  return batch


@pytest.mark.parametrize("backend, task", [
    ("inline", "raiselake_test"),
    ("threads", "raiselake_test"),
    ("threads", "hanglake_test"),  # 3 hung calls, 2 threads: the healthy calls still run.
    ("processes", "raiselake_test"),
    ("processes", "hanglake_test"),
    ("processes", "spinlake_test"),  # Holds the GIL: only a process can be stopped.
    ("processes", "crashlake_test"),  # The worker dies.
])
def test_a_bad_env_fails_only_its_own_episode(chat, clean, backend, task):
  """Every other episode is exactly the clean run, including those sharing a worker."""
  stepper = agent.EnvStepper(workers=2, timeout_s=TIMEOUT_S, backend=backend)
  start = time.perf_counter()
  got = _play(chat, f"{task}:easy", stepper)
  elapsed = time.perf_counter() - start
  bad = np.isin(SEEDS, faulty_envs.BAD_SEEDS)
  np.testing.assert_array_equal(got.failed, bad)
  assert (got.turns[bad] == 2).all() and not got.success[bad].any()
  for field in ("rewards", "success", "turns", "invalid_actions", "truncated"):
    np.testing.assert_array_equal(getattr(got, field)[~bad], getattr(clean, field)[~bad], field)
  for b in np.flatnonzero(~bad):
    n = int(clean.attention_mask[b].sum())
    np.testing.assert_array_equal(got.tokens[b, :n], clean.tokens[b, :n])
  # Hangs time out one after another at worst (3 x TIMEOUT_S), plus worker starts.
  assert elapsed < 60, elapsed
  assert not multiprocessing.active_children()  # The pool's workers are gone.


def test_training_rewards_leave_out_failed_nonfinite_and_lone_episodes():
  """NaN marks episodes left out: failed, non-finite reward, or alone in their group."""
  rewards = np.array([1.0, 0.0, np.inf, 0.5, -0.2, np.nan, 1.0, 0.0], np.float32)
  failed = np.array([0, 1, 0, 0, 0, 0, 0, 0], bool)
  groups = np.array([0, 0, 0, 1, 1, 1, 2, 2])  # Group 0 keeps one healthy member.
  batch = EpisodeBatch(
      tokens=np.zeros((8, 4), np.int32), attention_mask=np.ones((8, 4), bool),
      loss_mask=np.ones((8, 4), bool), logprobs=np.zeros((8, 4), np.float32),
      entropies=np.zeros((8, 4), np.float32), task_ids=np.zeros(8, np.int32), group_ids=groups,
      rewards=rewards, success=np.zeros(8, bool), turns=np.ones(8, np.int32),
      invalid_actions=np.zeros(8, np.int32), failed=failed, truncated=np.zeros(8, bool))
  got = training_rewards(batch)
  np.testing.assert_array_equal(np.isnan(got), [1, 1, 1, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(got[[3, 4, 6, 7]], rewards[[3, 4, 6, 7]])


class _LocalLake(FrozenLake):
  pass


def test_auto_backend():
  """auto: built-in fast tasks inline, other tasks in processes, unpicklable ones in threads."""
  def backend(*specs):
    return config_check.env_backend(smoke_config("/nonexistent", **{"tasks.specs": specs}))
  assert backend("sokoban:easy", "countdown:easy") == "inline"
  assert backend("sokoban:easy", "hanglake_test:easy") == "processes"
  assert backend("textworld_coin:easy") == "processes"

  class Unpicklable(FrozenLake):  # Defined in a function: a worker cannot import it.
    pass
  registry.register("unpicklable_test", Unpicklable, overwrite=True)
  assert backend("unpicklable_test:easy") == "threads"
  explicit = smoke_config("/nonexistent", **{"tasks.env_backend": "inline"})
  assert config_check.env_backend(explicit) == "inline"


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import faulty_envs
    from eppo_jax import envs
    pool = envs.EnvPool([faulty_envs.HangingLake() for _ in range(3)], num_workers=2,
                        timeout_s=0.5)
    pool.reset([5, 5, 1])
    results = pool.step(["right"] * 3)
    results = pool.step(["right"] * 3)  # The two seed-5 envs hang on their second step.
    print("failed", [r[3].get("failed", False) for r in results], pool.num_abandoned_threads,
          flush=True)
    pool.close()
""")


def test_abandoned_threads_do_not_keep_the_process_alive():
  """Two calls that never return: the batch ends after the timeout and the process exits."""
  script = _EXIT_SCRIPT.format(tests=str(ROOT / "tests"))
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "failed [True, True, False] 2" in proc.stdout
  assert time.perf_counter() - start < 60
