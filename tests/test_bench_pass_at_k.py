"""bench/pass_at_k.py's estimator and table against direct enumeration."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pass_at_k  # pylint: disable=g-import-not-at-top,wrong-import-position


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
