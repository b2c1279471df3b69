"""bench/grad_cosine.py's statistics against direct NumPy computations."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import grad_cosine  # pylint: disable=g-import-not-at-top,wrong-import-position


def _mean_pair_cosine(rows) -> float:
  cos = [a @ b / np.linalg.norm(a) / np.linalg.norm(b) for a, b in itertools.combinations(rows, 2)]
  return float(np.mean(cos))


def test_mean_pairwise_cosine_matches_pairs_and_leave_one_out():
  rng = np.random.default_rng(0)
  signal = rng.normal(size=50)
  grads = signal + 2.0 * rng.normal(size=(7, 50))  # A shared direction plus noise.
  mean, se = grad_cosine.mean_pairwise_cosine(grads)
  assert np.isclose(mean, _mean_pair_cosine(grads))
  # The jackknife over rows, from scratch: the mean of the pairs left when row i is out.
  n = len(grads)
  leave_out = np.array([_mean_pair_cosine(np.delete(grads, i, axis=0)) for i in range(n)])
  expected = np.sqrt((n - 1) / n * np.sum((leave_out - leave_out.mean()) ** 2))
  assert np.isclose(se, expected)
  assert 0 < mean < 1 and se > 0


def test_identical_and_opposite_batches():
  g = np.random.default_rng(1).normal(size=(1, 20))
  cos = grad_cosine.pairwise_cosines(np.concatenate([g, 3 * g, -g]))
  np.testing.assert_allclose(cos, [[1, 1, -1], [1, 1, -1], [-1, -1, 1]], atol=1e-12)
  np.testing.assert_allclose(grad_cosine.mean_pairwise_cosine(np.concatenate([g, 2 * g, 5 * g])),
                             (1.0, 0.0), atol=1e-12)


def test_leave_one_out_cosine_against_a_loop_and_where_sign_loses():
  rng = np.random.default_rng(2)
  # The signal sits in 5 of 200 weights; every weight has noise of the same size.
  signal = np.zeros(200)
  signal[:5] = 3.0
  grads = signal + rng.normal(size=(8, 200))
  expected = []
  for j in range(len(grads)):
    rest = np.delete(grads, j, axis=0).mean(0)
    expected.append(grads[j] @ rest / np.linalg.norm(grads[j]) / np.linalg.norm(rest))
  assert np.isclose(grad_cosine.leave_one_out_cosine(grads, grads), np.mean(expected))
  # A step that moves every weight alike spends most of its length on the 195 noise weights.
  sign = grad_cosine.leave_one_out_cosine(grads, np.sign(grads))
  assert sign < 0.6 * grad_cosine.leave_one_out_cosine(grads, grads)
