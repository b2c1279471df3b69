"""Zero-variance groups, dynamic sampling's selection and the spread filter, on hand-built
batches whose expected answers are worked out by hand."""

import numpy as np

from eppo_jax.episodes import EpisodeBatch, training_rewards
from eppo_jax import groups


def batch(rewards_by_group, tasks=None, width=4, failed=(), first_token=0):
  """An EpisodeBatch with the given rewards per group (one list per group); token t of episode
  b is first_token + b (so rows can be told apart after selection)."""
  rewards = [r for rs in rewards_by_group for r in rs]
  group_ids = [g for g, rs in enumerate(rewards_by_group) for _ in rs]
  tasks = tasks or [0] * len(rewards_by_group)
  n = len(rewards)
  return EpisodeBatch(
      tokens=np.repeat(np.arange(first_token, first_token + n, dtype=np.int32)[:, None], width, 1),
      attention_mask=np.ones((n, width), bool), loss_mask=np.ones((n, width), bool),
      logprobs=np.zeros((n, width), np.float32), entropies=np.zeros((n, width), np.float32),
      task_ids=np.array([tasks[g] for g in group_ids], np.int32),
      group_ids=np.array(group_ids, np.int32), rewards=np.array(rewards, np.float32),
      success=np.zeros(n, bool), turns=np.ones(n, np.int32), invalid_actions=np.zeros(n, np.int32),
      failed=np.isin(np.arange(n), failed), truncated=np.zeros(n, bool))


def test_zero_variance_counts_valid_rewards_only():
  # Group 1 differs only through a failed episode (left out): zero variance. Group 3 has one
  # valid episode: nothing to compare, zero variance.
  b = batch([[1, 0], [1, 1, 5], [0, 0], [2, 7]], tasks=[0, 1, 1, 0], failed=(4, 8))
  np.testing.assert_array_equal(groups.zero_variance(b), [False, True, True, True])
  np.testing.assert_allclose(groups.group_spread(b)[:1], [0.5])
  np.testing.assert_array_equal(groups.per_task_zero_variance(b, 3), [[1, 2, 0], [2, 2, 0]])


def test_select_groups_prefers_groups_that_differ_in_play_order():
  first = batch([[1, 1], [0, 1], [3, 3]])
  second = batch([[2, 0], [4, 4], [1, 2]], first_token=6)
  played = groups.concat([first, second])
  np.testing.assert_array_equal(played.group_ids, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
  chosen, shortfall = groups.select_groups(played, 3)
  # Groups that differ: 1 (round 1), 3 and 5 (round 2), in play order; nothing is short.
  np.testing.assert_array_equal(chosen.tokens[:, 0], [2, 3, 6, 7, 10, 11])
  np.testing.assert_array_equal(chosen.group_ids, [0, 0, 1, 1, 2, 2])
  assert shortfall == 0
  # Four wanted: the fourth is the first zero-variance group played (0), counted as the
  # shortfall, in its place in the order of play.
  chosen, shortfall = groups.select_groups(played, 4)
  np.testing.assert_array_equal(chosen.tokens[:, 0], [0, 1, 2, 3, 6, 7, 10, 11])
  assert shortfall == 1
  # One round kept whole is the batch as played.
  chosen, shortfall = groups.select_groups(first, 3)
  np.testing.assert_array_equal(chosen.tokens, first.tokens)
  assert shortfall == 2


def test_concat_pads_token_axes_and_keeps_per_turn_records():
  a, b = batch([[1, 0]], width=3), batch([[0, 2]], width=5)
  a = EpisodeBatch(**{**vars(a), "step_rewards": np.ones((2, 4), np.float32)})
  b = EpisodeBatch(**{**vars(b), "step_rewards": np.zeros((2, 4), np.float32)})
  both = groups.concat([a, b])
  assert both.tokens.shape == (4, 5) and both.step_rewards.shape == (4, 4)
  np.testing.assert_array_equal(both.attention_mask.sum(1), [3, 3, 5, 5])
  np.testing.assert_array_equal(both.step_rewards[:, 0], [1, 1, 0, 0])


def test_spread_filter_keeps_the_widest_groups():
  b = batch([[0, 0], [0, 4], [1, 2], [5, 5], [0, 9]])
  # Spreads: 0, 2, 0.5, 0, 4.5 -> keep 0.4 x 5 = 2 groups: 4 and 1.
  np.testing.assert_array_equal(groups.spread_filter(b, 0.4),
                                np.isin(b.group_ids, [1, 4]))
  assert groups.spread_filter(b, 1.0).all()
  # ceil(0.5 x 5) = 3 groups; the tie between groups 0 and 3 (both 0) is not reached.
  np.testing.assert_array_equal(groups.spread_filter(b, 0.5), np.isin(b.group_ids, [1, 2, 4]))
