"""The episode batch: what the episode loop hands to the estimators, the metrics and the update.

`agent.collect_episodes` produces it, `gigpo` and `groups` read it, and the trainer turns it into
the update's arrays; with the types here, each of them imports the data without the loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import numpy as np


@dataclasses.dataclass
class EpisodeBatch:
  """Host arrays for B episodes; sequences are right-padded to a bucketed length T."""

  tokens: np.ndarray  # [B,T] int32
  attention_mask: np.ndarray  # [B,T] bool
  loss_mask: np.ndarray  # [B,T] bool: the assistant's generated tokens only
  logprobs: np.ndarray  # [B,T] float32: the sampler's log pi(token) on loss tokens, else 0
  entropies: np.ndarray  # [B,T] float32: the sampler's entropy at each loss token, else 0
  task_ids: np.ndarray  # [B] int32
  group_ids: np.ndarray  # [B] int32: episodes of one instance share a group id
  rewards: np.ndarray  # [B] float32: episode return
  success: np.ndarray  # [B] bool: the environment's own verdict
  turns: np.ndarray  # [B] int32
  invalid_actions: np.ndarray  # [B] int32
  failed: np.ndarray  # [B] bool: the environment raised or timed out
  truncated: np.ndarray  # [B] bool: cut by the turn or token budget
  # [B,T] bool: the loss tokens that spell each reply's action (`agent.ChatFormat.action_mask`).
  action_mask: Optional[np.ndarray] = None
  # Per-turn records for step-level credit (eppo_jax.gigpo); None where a producer has none.
  # `gather_hosts` pads a narrower host's T axis with 0, not -1: read turn_ids with loss_mask.
  turn_ids: Optional[np.ndarray] = None  # [B,T] int32: turn of each loss token, -1 elsewhere
  step_rewards: Optional[np.ndarray] = None  # [B,max_turns] float32: reward of each turn, else 0
  # [B,max_turns] int64: `observation_hash` of the text shown before each turn, -1 past the end.
  step_states: Optional[np.ndarray] = None

  @property
  def num_tokens(self) -> np.ndarray:
    return self.attention_mask.sum(axis=1)

  def replies(self, tokenizer, b: int) -> list[str]:
    """Decoded assistant turns of episode `b` (maximal runs of loss-masked tokens)."""
    mask = self.loss_mask[b]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return [tokenizer.decode(self.tokens[b, s:e]) for s, e in zip(edges[::2], edges[1::2])]


# The per-turn records: what only the host that played an episode needs (`eppo_jax.gigpo`).
PER_TURN_FIELDS = ("turn_ids", "step_rewards", "step_states")


def training_rewards(episodes: EpisodeBatch) -> np.ndarray:
  """Rewards [B] for the update, NaN where an episode is left out: it failed (the env raised or
  timed out), its reward is not finite, or it is the only healthy member of its group (nothing to
  compare it with). The update gives NaN-reward episodes no loss token and no weight in their
  group's statistics (`steps.train_step`, `objective.grpo_advantages`)."""
  healthy = ~episodes.failed & np.isfinite(episodes.rewards)
  groups, index = np.unique(episodes.group_ids, return_inverse=True)
  healthy_per_group = np.bincount(index, weights=healthy, minlength=len(groups))
  keep = healthy & (healthy_per_group[index] >= 2)
  return np.where(keep, episodes.rewards, np.nan).astype(np.float32)


def observation_hash(text: str) -> int:
  """A 63-bit digest of an observation, the same in every process and run (unlike `hash`)."""
  digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "little") >> 1  # >= 0, so -1 can mark "no turn".
