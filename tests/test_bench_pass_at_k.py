"""bench/pass_at_k.py's estimator and table against direct enumeration."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pass_at_k  # pylint: disable=g-import-not-at-top,wrong-import-position

from eppo_jax.agent import Instance  # pylint: disable=g-bad-import-order
from eppo_jax.episodes import EpisodeBatch  # pylint: disable=g-bad-import-order


def _enumerated(samples, k: int) -> float:
  """The share of the k-subsets of one instance's samples that hold a success."""
  subsets = list(itertools.combinations(samples, k))
  return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_success():
  n = 8
  rng = np.random.default_rng(0)
  samples = rng.random((30, n)) < rng.random((30, 1))  # Instances of every success rate.
  samples[0], samples[1] = False, True  # None and all.
  c = samples.sum(axis=1)
  for k in range(1, n + 1):
    expected = [_enumerated(row, k) for row in samples]
    np.testing.assert_allclose(pass_at_k.pass_at_k(n, c, k), expected, atol=1e-12)
  np.testing.assert_allclose(pass_at_k.pass_at_k(n, c, 1), c / n)  # pass@1: the mean.
  with pytest.raises(ValueError, match="pass@9"):
    pass_at_k.pass_at_k(n, c, 9)


def test_task_table_groups_the_samples_by_instance_and_task():
  n = 2
  task_ids_I = np.array([0, 1, 0])
  # Instance 0: both samples succeed; instance 1: one; instance 2: none.
  sampled = {"success": np.array([1, 1, 1, 0, 0, 0], bool),
             "invalid_actions": np.array([0, 2, 1, 1, 4, 0]),
             "truncated": np.array([0, 0, 1, 0, 1, 1], bool),
             "turns": np.array([2, 4, 6, 6, 8, 8])}
  rows = pass_at_k.task_table(["a", "b"], task_ids_I, np.array([1, 0, 0], bool), sampled, n,
                              [1, 2])
  a, b = rows
  assert (a["task"], a["instances"], b["instances"]) == ("a", 2, 1)
  assert a["greedy"] == 0.5 and b["greedy"] == 0.0
  assert a["pass@1"] == 0.5 and a["pass@2"] == 0.5 and a["varied"] == 0.0
  assert b["pass@1"] == 0.5 and b["pass@2"] == 1.0 and b["varied"] == 1.0
  assert a["invalid_actions"] == np.mean([0, 2, 4, 0]) and b["turns"] == 6.0
  assert a["truncated"] == 0.5


def test_the_train_pool_is_every_seed_a_run_with_that_pool_draws():
  from eppo_jax.envs.sampler import TaskSampler  # pylint: disable=g-import-not-at-top
  sampler = TaskSampler(["a", "b"], seed=3, num_train_instances=5)
  pool = pass_at_k.instance_list(sampler, 5, "train")
  assert set(sampler.sample(400)) == set(pool) and len(pool) == 10
  held_out = pass_at_k.instance_list(sampler, 5, "held_out")
  assert held_out == sampler.eval_instances(5) and not set(held_out) & set(pool)


def test_the_train_pool_defaults_to_the_runs_rooms_and_refuses_rooms_it_never_had():
  from configs import multitask  # pylint: disable=g-import-not-at-top
  config = multitask.base_config()
  config.train.eval_instances_per_task = 64
  assert pass_at_k.instances_per_task(config, None, "held_out") == 64
  assert pass_at_k.instances_per_task(config, 500, "held_out") == 500
  with pytest.raises(ValueError, match="needs --instances"):
    pass_at_k.instances_per_task(config, None, "train")  # Every seed: no pool to default to.
  assert pass_at_k.instances_per_task(config, 8, "train") == 8
  config.tasks.train_instances = 32
  assert pass_at_k.instances_per_task(config, None, "train") == 32
  assert pass_at_k.instances_per_task(config, 4, "train") == 4
  with pytest.raises(ValueError, match="33 > this run's pool of 32"):
    pass_at_k.instances_per_task(config, 33, "train")


def test_a_run_recorded_before_a_field_existed_loads_with_its_default(tmp_path):
  """config.json of an older run (no tasks.train_instances) loads with the default for the new
  field and the run's own value for every recorded one."""
  import json  # pylint: disable=g-import-not-at-top
  import common  # pylint: disable=g-import-not-at-top
  from configs import multitask  # pylint: disable=g-import-not-at-top
  recorded = json.loads(multitask.base_config().to_json())
  del recorded["tasks"]["train_instances"]
  recorded["optim"]["learning_rate"] = 1e-3
  recorded["tasks"]["specs"] = ["frozenlake:easy"]
  (tmp_path / "config.json").write_text(json.dumps(recorded))
  config = common.load_run_config(tmp_path, [("rollout.group_size", "4")])
  assert config.tasks.train_instances == 0 and config.optim.learning_rate == 1e-3
  assert config.tasks.specs == ("frozenlake:easy",) and config.rollout.group_size == 4


class _Letters:
  """A tokenizer stand-in: token id i decodes to the i-th letter."""

  def decode(self, ids) -> str:
    return "".join(chr(ord("a") + int(i)) for i in ids)


def _chunk(replies: list[list[list[int]]], success: list[bool]) -> EpisodeBatch:
  """Episodes whose assistant turns are `replies[b]`, each turn after one prompt token (id 25)."""
  n = len(replies)
  width = max(sum(len(turn) + 1 for turn in episode) for episode in replies)  # [T]
  tokens, loss = np.full((n, width), 25, np.int32), np.zeros((n, width), bool)  # [B,T]
  for b, episode in enumerate(replies):
    at = 0
    for turn in episode:
      at += 1  # The prompt token.
      tokens[b, at:at + len(turn)], loss[b, at:at + len(turn)] = turn, True
      at += len(turn)
  zeros = np.zeros(n, np.int32)
  return EpisodeBatch(tokens=tokens, attention_mask=np.ones_like(loss), loss_mask=loss,
                      logprobs=np.zeros(loss.shape, np.float32),
                      entropies=np.zeros(loss.shape, np.float32), task_ids=zeros,
                      group_ids=np.arange(n, dtype=np.int32), rewards=np.zeros(n, np.float32),
                      success=np.array(success), turns=np.array([len(r) for r in replies]),
                      invalid_actions=zeros, failed=np.zeros(n, bool), truncated=np.zeros(n, bool))


def test_show_replies_pairs_each_instance_with_its_episode_across_chunks(capsys):
  instances = [Instance(0, "a", 10), Instance(1, "b", 11), Instance(0, "a", 12),
               Instance(1, "b", 13)]
  # Two chunks of two episodes, in instance order; only the first instance of each task shows.
  parts = [_chunk([[[0, 1], [2]], [[3]]], [False, True]),
           _chunk([[[4]], [[5, 6], [7], [8]]], [False, False])]
  pass_at_k.show_replies(_Letters(), parts, instances, per_task=1, turns=2)
  out = capsys.readouterr().out
  assert "a seed 10 (greedy, success False, 0 invalid of 2 turns)" in out
  assert "turn 1: 'ab'" in out and "turn 2: 'c'" in out
  assert "b seed 11 (greedy, success True" in out and "turn 1: 'd'" in out
  assert "seed 12" not in out and "seed 13" not in out
