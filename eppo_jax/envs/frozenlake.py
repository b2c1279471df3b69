"""FrozenLake: gymnasium's FrozenLake-v1 on random maps, with a text render and an exact expert."""

from __future__ import annotations

import collections
import copy
import dataclasses

import numpy as np

from eppo_jax.envs.base import TextEnv, Transition, instance_rng

# gymnasium's action ids.
ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}
DELTAS = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}
WIN_REWARD = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenLakeLevel:
  """Map side, probability that a cell is frozen, slipperiness and the step limit."""
  size: int
  frozen_prob: float
  slippery: bool
  max_steps: int


LEVELS = {
    "easy": FrozenLakeLevel(size=4, frozen_prob=0.8, slippery=False, max_steps=12),
    "medium": FrozenLakeLevel(size=6, frozen_prob=0.75, slippery=False, max_steps=20),
    # Slippery: the intended move happens with probability 1/3, else a perpendicular one, so
    # even the optimal policy fails sometimes (see `success_probability`).
    "hard": FrozenLakeLevel(size=4, frozen_prob=0.8, slippery=True, max_steps=30),
}

INSTRUCTIONS = """You are crossing a frozen lake on a grid. Walk from the start to the goal without falling into a hole.
Legend: S start, F frozen ice (safe), H hole, G goal, P you.
Actions: left, down, right, up. Walking off the edge leaves you in place. On slippery ice you may slide sideways instead of where you meant to go.
Reply with exactly one action, for example <action>down</action>."""


class FrozenLake(TextEnv):
  """Reach G without falling into a hole: +1 on reaching the goal, 0 otherwise."""

  task_name = "frozenlake"
  LEVELS = LEVELS
  instructions = INSTRUCTIONS

  def __init__(self, level: str | None = None, max_steps: int | None = None):
    super().__init__(level, max_steps)
    self.gym_env = None
    self.desc: list[str] = []

  def _reset(self, seed: int) -> str:
    # Imported here so the rest of the package works without gymnasium.
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map
    map_seed = instance_rng(self.task_name, self.level, seed).getrandbits(32)
    cfg = self.config
    self.desc = generate_random_map(size=cfg.size, p=cfg.frozen_prob, seed=map_seed)
    self.gym_env = FrozenLakeEnv(desc=self.desc, is_slippery=cfg.slippery)
    # Seeding the slips too makes an instance fully reproducible, so expert plans replay exactly.
    self.gym_env.reset(seed=map_seed)
    return self.render()

  @property
  def position(self) -> tuple[int, int]:
    return divmod(int(self.gym_env.s), self.config.size)

  def render(self) -> str:
    """The map with the player drawn as P, cells apart (one token each for any tokenizer)."""
    rows = [list(row) for row in self.desc]
    r, c = self.position
    rows[r][c] = "P"
    return "\n".join(" ".join(row) for row in rows)

  def _step(self, action: str) -> Transition:
    if action not in ACTIONS:
      return self.invalid(f"Unknown action '{action[:20]}'. Use left, down, right or up.")
    before = self.position
    state, reward, terminated, _, _ = self.gym_env.step(ACTIONS[action])
    after = self.position
    moved = _direction(before, after)
    if moved == action or moved is None and _off_edge(before, ACTIONS[action], self.config.size):
      feedback = f"You move {action}." if moved else "You bump into the edge."
    else:
      feedback = f"You try to move {action} but slip {moved or 'in place'}."
    cell = self.desc[after[0]][after[1]]
    if cell == "G":
      return Transition(f"{feedback} You reached the goal!\n{self.render()}", WIN_REWARD, done=True,
                        won=True)
    if cell == "H":
      return Transition(f"{feedback} You fell into a hole.\n{self.render()}", 0.0, done=True)
    return Transition(f"{feedback}\n{self.render()}", 0.0)

  def success_probability(self) -> float:
    """The optimal probability of reaching the goal from the current state in the steps left."""
    values = value_iteration(self.gym_env.P, self.max_steps - self._steps)
    return float(values[-1][int(self.gym_env.s)])

  def solve(self) -> list[str]:
    """Shortest path when not slippery; else the optimal policy played on a copy of the env.

    The copy carries the env's random state, so replaying the returned actions reproduces the
    same slips: the plan succeeds exactly when the simulated episode did.
    """
    if not self.config.slippery:
      return shortest_path(self.desc, self.position)
    sim = copy.deepcopy(self.gym_env)
    horizon = self.max_steps - self._steps
    values = value_iteration(sim.P, horizon)
    actions = []
    for left in range(horizon, 0, -1):
      action = _greedy(sim.P, values[left - 1], int(sim.s))
      actions.append(ACTION_NAMES[action])
      _, _, terminated, _, _ = sim.step(action)
      if terminated:
        break
    return actions

  def admissible_actions(self) -> list[str]:
    return list(ACTIONS)


def _direction(before: tuple[int, int], after: tuple[int, int]) -> str | None:
  for action, (dr, dc) in DELTAS.items():
    if (before[0] + dr, before[1] + dc) == after:
      return ACTION_NAMES[action]
  return None


def _off_edge(pos: tuple[int, int], action: int, size: int) -> bool:
  dr, dc = DELTAS[action]
  return not (0 <= pos[0] + dr < size and 0 <= pos[1] + dc < size)


def shortest_path(desc: list[str], start: tuple[int, int]) -> list[str]:
  """Breadth-first shortest action list from `start` to G avoiding holes ([] if none)."""
  size = len(desc)
  parent = {start: None}
  queue = collections.deque([start])
  while queue:
    pos = queue.popleft()
    if desc[pos[0]][pos[1]] == "G":
      path = []
      while parent[pos] is not None:
        pos, action = parent[pos]
        path.append(ACTION_NAMES[action])
      return path[::-1]
    for action, (dr, dc) in DELTAS.items():
      nxt = (pos[0] + dr, pos[1] + dc)
      if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in parent \
          and desc[nxt[0]][nxt[1]] != "H":
        parent[nxt] = (pos, action)
        queue.append(nxt)
  return []


def value_iteration(transitions: dict, horizon: int) -> list[np.ndarray]:
  """values[k][s] = best probability of reaching the goal from s within k steps (k = 0..horizon)."""
  num_states = len(transitions)
  values = [np.zeros(num_states)]
  for _ in range(horizon):
    prev, current = values[-1], np.zeros(num_states)
    for s in range(num_states):
      current[s] = max(_q(transitions, prev, s, a) for a in range(4))
    values.append(current)
  return values


def _q(transitions: dict, next_values: np.ndarray, s: int, a: int) -> float:
  # Reward 1 comes only on entering G, which is terminal, so success = reward + continuation.
  return sum(p * (r + (0.0 if done else next_values[s2])) for p, s2, r, done in transitions[s][a])


def _greedy(transitions: dict, next_values: np.ndarray, s: int) -> int:
  return max(range(4), key=lambda a: _q(transitions, next_values, s, a))
