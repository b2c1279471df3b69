r"""GiGPO advantages on the host: group-relative credit per episode and per anchor state.

Group-in-Group Policy Optimization (Feng et al. 2025, arXiv 2505.10978) keeps GRPO's critic-free
episode groups and adds a second, finer level inside each group. With the G episodes
tau_1..tau_G of one task instance (one `group_ids` value), turn t of episode i answering the
observation s_t^(i) and earning the reward r_t^(i):

  Episode level (the macro advantage, GRPO's):

      A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm({R(tau_j)}),    R(tau) = sum_t r_t

  Step level (the micro advantage). Every observation text is an *anchor state*; the turns
  (i, t) of the group's episodes that answer the same text, revisits within one episode
  included, form its step group G^S(s). Each turn is scored by its discounted return

      R_t^(i) = sum_{k >= t} gamma^(k - t) r_k^(i)
      A^S(a_t^(i)) = (R_t^(i) - mean_{(j, k) in G^S(s_t^(i))} R_k^(j)) / F_norm(G^S(s_t^(i)))

  Combined, for every loss token of turn t's reply:

      A(a_t^(i)) = A^E(tau_i) + omega * A^S(a_t^(i))

F_norm is the group's unbiased std plus `eps`, as in `objective.grpo_advantages`'s "grpo", or 1
(`normalize=False`; for the step level `step_normalize`). As there, a group of one and a group
whose values are all equal give exactly 0 (equality decided by max == min, so a rounding residue
is not blown up by the std), and an episode left out of the update (NaN training reward,
`episodes.training_rewards`) counts in no group statistic and gets advantage 0. A state seen only
once has nothing to compare with: its A^S is 0. The first turn of every episode of a group
answers the same reset observation, so turn 0's step group is the whole episode group.

The anchor is the observation text exactly as the environment returned it: two turns match only
if the texts are identical (a feedback line such as "You moved up." makes otherwise equal boards
differ), and a message that omits the board (the built-in games' invalid-action replies) matches
across different underlying states.

Every statistic stays within one episode group, and a group's episodes are all played on one
host: each host computes its own episodes' advantages, with no collective.
"""

from __future__ import annotations

import numpy as np

from eppo_jax.episodes import EpisodeBatch, training_rewards


def _relative(x_N: np.ndarray, keys_NxK: np.ndarray, normalize: bool, eps: float) -> np.ndarray:
  """(x - mean) / F_norm within each group of identical key rows; 0 for degenerate groups."""
  if not len(x_N):
    return np.zeros(0)
  _, g_N = np.unique(keys_NxK, axis=0, return_inverse=True)
  g_N = g_N.reshape(-1)
  n_G = np.bincount(g_N).astype(np.float64)
  mean_G = np.bincount(g_N, weights=x_N) / n_G
  dev_N = x_N - mean_G[g_N]
  std_G = np.sqrt(np.bincount(g_N, weights=dev_N**2) / np.maximum(n_G - 1.0, 1.0))  # ddof = 1
  hi_G, lo_G = np.full(len(n_G), -np.inf), np.full(len(n_G), np.inf)
  np.maximum.at(hi_G, g_N, x_N)
  np.minimum.at(lo_G, g_N, x_N)
  # A lone entry is all-equal too; such groups are masked, so their 0 / 0 is never read.
  degenerate_N = (hi_G == lo_G)[g_N]
  with np.errstate(invalid="ignore", divide="ignore"):
    adv_N = dev_N / (std_G[g_N] + eps) if normalize else dev_N
  return np.where(degenerate_N, 0.0, adv_N)


def episode_advantages(rewards_B: np.ndarray, group_ids_B: np.ndarray, *, normalize: bool = True,
                       eps: float = 1e-6) -> np.ndarray:
  """A^E [B] float64 from episode returns; NaN (or inf) rewards are left out and get 0."""
  r_B = np.asarray(rewards_B, np.float64)
  ok_B = np.isfinite(r_B)
  out_B = np.zeros(len(r_B))
  out_B[ok_B] = _relative(r_B[ok_B], np.asarray(group_ids_B, np.int64)[ok_B, None], normalize,
                          eps)
  return out_B


def discounted_returns(step_rewards_BxN: np.ndarray, gamma: float) -> np.ndarray:
  """R_t = sum_{k >= t} gamma^(k - t) r_k per turn, [B, N] float64 (rewards past the end are 0)."""
  r_BxN = np.asarray(step_rewards_BxN, np.float64)
  out_BxN = np.zeros_like(r_BxN)
  following_B = np.zeros(r_BxN.shape[0])
  for t in range(r_BxN.shape[1] - 1, -1, -1):
    following_B = r_BxN[:, t] + gamma * following_B
    out_BxN[:, t] = following_B
  return out_BxN


def step_advantages(returns_BxN: np.ndarray, step_states_BxN: np.ndarray,
                    group_ids_B: np.ndarray, valid_B: np.ndarray, *, normalize: bool = True,
                    eps: float = 1e-6) -> np.ndarray:
  """A^S [B, N] float64: each turn's return against the turns of its episode group that answer
  the same state (`step_states`, -1 = no turn); 0 off the turns and for invalid episodes."""
  states_BxN = np.asarray(step_states_BxN, np.int64)
  turn_BxN = (states_BxN >= 0) & np.asarray(valid_B, bool)[:, None]
  groups_BxN = np.broadcast_to(np.asarray(group_ids_B, np.int64)[:, None], states_BxN.shape)
  keys_Mx2 = np.stack([groups_BxN[turn_BxN], states_BxN[turn_BxN]], axis=1)
  out_BxN = np.zeros(states_BxN.shape)
  out_BxN[turn_BxN] = _relative(np.asarray(returns_BxN, np.float64)[turn_BxN], keys_Mx2,
                                normalize, eps)
  return out_BxN


def _check(gamma: float, omega: float) -> None:
  if not 0.0 < gamma <= 1.0:
    raise ValueError(f"GiGPO gamma must be in (0, 1], got {gamma}")
  if not (np.isfinite(omega) and omega >= 0.0):
    raise ValueError(f"GiGPO omega must be finite and >= 0, got {omega}")


def turn_advantages(rewards_B: np.ndarray, group_ids_B: np.ndarray, step_rewards_BxN: np.ndarray,
                    step_states_BxN: np.ndarray, *, gamma: float, omega: float,
                    step_normalize: bool = True, eps: float = 1e-6) -> np.ndarray:
  """A = A^E + omega A^S per turn, [B, N] float64; 0 off the turns and where the reward is NaN.

  `rewards_B` are the training rewards (NaN = left out), `step_states_BxN` the anchor-state
  hashes (-1 past an episode's last turn) and `step_rewards_BxN` the reward of each turn.
  """
  _check(gamma, omega)
  valid_B = np.isfinite(np.asarray(rewards_B, np.float64))
  adv_e_B = episode_advantages(rewards_B, group_ids_B, eps=eps)
  adv_s_BxN = step_advantages(discounted_returns(step_rewards_BxN, gamma), step_states_BxN,
                              group_ids_B, valid_B, normalize=step_normalize, eps=eps)
  turn_BxN = (np.asarray(step_states_BxN) >= 0) & valid_B[:, None]
  return np.where(turn_BxN, adv_e_B[:, None] + omega * adv_s_BxN, 0.0)


def spread_over_tokens(turn_adv_BxN: np.ndarray, turn_ids_BxT: np.ndarray,
                       loss_mask_BxT: np.ndarray) -> np.ndarray:
  """[B, T] float32: each loss token gets its turn's advantage, every other token 0."""
  turn_ids_BxT = np.asarray(turn_ids_BxT, np.int64)
  n = turn_adv_BxN.shape[1]
  on_BxT = np.asarray(loss_mask_BxT, bool) & (turn_ids_BxT >= 0) & (turn_ids_BxT < n)
  picked_BxT = np.take_along_axis(turn_adv_BxN, np.clip(turn_ids_BxT, 0, max(n - 1, 0)), axis=1)
  return np.where(on_BxT, picked_BxT, 0.0).astype(np.float32)


def token_advantages(episodes: EpisodeBatch, *, gamma: float = 0.95, omega: float = 1.0,
                     step_normalize: bool = True, eps: float = 1e-6) -> np.ndarray:
  """GiGPO advantage of every token of `episodes`, [B, T] float32 aligned with `loss_mask`.

  Episodes that `episodes.training_rewards` leaves out get 0 and weigh in no group. Call it on one
  host's own episodes (whole groups, local `group_ids`), before any gather over hosts.
  """
  if episodes.turn_ids is None or episodes.step_rewards is None or episodes.step_states is None:
    raise ValueError("GiGPO needs per-turn records (turn_ids, step_rewards, step_states); "
                     "these episodes have none: play them with agent.collect_episodes")
  turn_adv_BxN = turn_advantages(training_rewards(episodes), episodes.group_ids,
                                 episodes.step_rewards, episodes.step_states, gamma=gamma,
                                 omega=omega, step_normalize=step_normalize, eps=eps)
  return spread_over_tokens(turn_adv_BxN, episodes.turn_ids, episodes.loss_mask)
