"""Which groups an RL step trains on: zero-variance groups, dynamic sampling, the spread filter.

A group (the G episodes of one task instance) whose training rewards are all equal has zero
advantage under every group-relative estimator: it adds no gradient, only tokens. Two remedies,
both host-side NumPy on one host's episodes (whole groups live on one host):

    zero_variance      groups whose valid rewards do not differ (fewer than two valid: also)
    select_groups      dynamic sampling (DAPO): from several rounds of groups, the batch's
                       groups, those with rewards that differ first, kept in the order played
    spread_filter      RAGEN's filter: of the batch's groups, train on the `keep` fraction with
                       the largest reward spread (the others' rewards become NaN: left out)

The update's batch keeps its static shape (instances_per_step x group_size rows) either way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eppo_jax.episodes import EpisodeBatch, training_rewards


def group_spread(episodes: EpisodeBatch) -> np.ndarray:
  """[G] the standard deviation of each group's training rewards (groups 0..G-1 in order); 0
  for a group with fewer than two valid episodes (`episodes.training_rewards`)."""
  rewards = training_rewards(episodes).astype(np.float64)
  groups = int(episodes.group_ids.max()) + 1 if len(rewards) else 0
  spread = np.zeros(groups)
  for g in range(groups):
    valid = rewards[(episodes.group_ids == g) & np.isfinite(rewards)]
    spread[g] = valid.std() if len(valid) >= 2 else 0.0
  return spread


def zero_variance(episodes: EpisodeBatch) -> np.ndarray:
  """[G] bool: groups whose valid rewards are all equal (zero advantage, no gradient)."""
  return group_spread(episodes) == 0


def per_task_zero_variance(episodes: EpisodeBatch, num_tasks: int) -> np.ndarray:
  """[2, K] float64: (zero-variance groups, groups) per task, to be summed over hosts."""
  flat = zero_variance(episodes)
  task_G = np.zeros(len(flat), np.int64)
  task_G[episodes.group_ids] = episodes.task_ids
  return np.stack([np.bincount(task_G, weights=flat.astype(np.float64), minlength=num_tasks),
                   np.bincount(task_G, minlength=num_tasks).astype(np.float64)])


# EpisodeBatch fields with a token axis [B,T].
_TOKEN_FIELDS = ("tokens", "attention_mask", "loss_mask", "logprobs", "entropies", "turn_ids",
                 "action_mask")


def concat(batches: list[EpisodeBatch]) -> EpisodeBatch:
  """Episode batches played one after another as one batch; group ids are renumbered after each
  other and [B,T] arrays padded with zeros (False) to the widest."""
  if len(batches) == 1:
    return batches[0]
  width = max(b.tokens.shape[1] for b in batches)
  fields, offset = {f.name: [] for f in dataclasses.fields(EpisodeBatch)}, 0
  for batch in batches:
    for name, value in dataclasses.asdict(batch).items():
      if name == "group_ids":
        value = value + offset
      elif value is not None and name in _TOKEN_FIELDS:
        value = np.pad(value, ((0, 0), (0, width - value.shape[1])))
      fields[name].append(value)
    offset += int(batch.group_ids.max()) + 1 if len(batch.group_ids) else 0
  return EpisodeBatch(**{k: None if any(v is None for v in vs) else np.concatenate(vs)
                         for k, vs in fields.items()})


def take_groups(episodes: EpisodeBatch, groups: np.ndarray) -> EpisodeBatch:
  """The episodes of `groups` (in that order), renumbered 0..len(groups)-1."""
  rows = np.concatenate([np.flatnonzero(episodes.group_ids == g) for g in groups])
  new_id = np.full(int(episodes.group_ids.max()) + 1, -1, np.int32)
  new_id[groups] = np.arange(len(groups), dtype=np.int32)
  fields = {k: None if v is None else v[rows] for k, v in dataclasses.asdict(episodes).items()}
  fields["group_ids"] = new_id[episodes.group_ids[rows]]
  return EpisodeBatch(**fields)


def select_groups(played: EpisodeBatch, count: int) -> tuple[EpisodeBatch, int]:
  """`count` groups of `played` (all rounds, `concat`): those whose rewards differ, then the
  zero-variance ones played first to fill the batch -> (batch, shortfall: the zero-variance
  groups it holds). The batch keeps the order of play, so a round that is kept whole is the
  batch as played, the same rows in the same minibatches however many hosts share it."""
  flat = zero_variance(played)
  chosen = np.concatenate([np.flatnonzero(~flat), np.flatnonzero(flat)])[:count]
  return take_groups(played, np.sort(chosen)), int(flat[chosen].sum())


def spread_filter(episodes: EpisodeBatch, keep: float) -> np.ndarray:
  """[B] bool: the rows of the ceil(keep x G) groups with the largest reward spread (ties: the
  earlier group); the update leaves the other rows out."""
  spread = group_spread(episodes)
  kept = np.argsort(-spread, kind="stable")[:int(np.ceil(keep * len(spread)))]
  return np.isin(episodes.group_ids, kept)
