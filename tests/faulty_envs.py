"""Environments that hang, crash or score by a known rule on purpose, importable by env worker
processes.

Each misbehaving one is a FrozenLake that misbehaves on its second step when the instance seed is
in `BAD_SEEDS`; any other instance plays exactly like FrozenLake. `FlatLake` scores every episode
0; `LeftLake` is a one-turn bandit that pays for "left" only. Kept free of test-only imports so
that a worker process can unpickle the classes quickly.
"""

import multiprocessing
import os
import threading

from eppo_jax.envs import FrozenLake, registry

BAD_SEEDS = (5, 6, 7)  # Instances that misbehave.
_NEVER = threading.Event()  # Never set: waiting on it blocks for good.


class _Misbehaving(FrozenLake):
  def step(self, action):
    if self.seed in BAD_SEEDS and self._steps == 1:
      self.misbehave()
    return super().step(action)

  def misbehave(self):
    raise NotImplementedError


class HangingLake(_Misbehaving):
  """Blocks forever in Python (the GIL is released while waiting)."""

  def misbehave(self):
    _NEVER.wait()


class AlwaysHangingLake(HangingLake):
  """Blocks forever on the second step of every instance."""

  def step(self, action):
    if self._steps == 1:
      self.misbehave()
    return FrozenLake.step(self, action)


class SpinningLake(_Misbehaving):
  """Spins in a C loop that holds the GIL for minutes; only in a worker process, so a test that
  steps it in its own process fails instead of freezing."""

  def misbehave(self):
    if multiprocessing.parent_process() is None:
      raise RuntimeError("SpinningLake only spins in a worker process")
    sum(range(10**11))


class CrashingLake(_Misbehaving):
  """Kills its own process, as a segfault in a C engine would."""

  def misbehave(self):
    if multiprocessing.parent_process() is None:
      raise RuntimeError("CrashingLake only crashes in a worker process")
    os._exit(11)


class RaisingLake(_Misbehaving):
  """Raises an exception."""

  def misbehave(self):
    raise RuntimeError("injected environment fault")


class FlatLake(FrozenLake):
  """Ends every episode after its first turn with reward 0, whatever the action: every group's
  rewards are equal, so no update has a signal."""

  def step(self, action):
    observation, _, _, info = super().step(action)
    return observation, 0.0, True, info


class LeftLake(FrozenLake):
  """A one-turn bandit on a FrozenLake map: "left" wins (reward 1), any other move ends the episode
  with 0. Its expert says "left" on even instances and "right" on odd ones, so a warm start from
  its demonstrations picks either about half the time, and only RL can prefer "left"."""

  def step(self, action):
    observation, reward, _, info = super().step(action)
    if not info["invalid_action"]:
      self._won = action == "left"
      reward, info = float(self._won), self._info(invalid=False, truncated=False)
    return observation, reward, True, info

  def solve(self):
    return ["left" if self.seed % 2 == 0 else "right"]


NAMES = {"hanglake_test": HangingLake, "alwayshang_test": AlwaysHangingLake, "spinlake_test": SpinningLake,
         "crashlake_test": CrashingLake, "raiselake_test": RaisingLake, "flatlake_test": FlatLake,
         "leftlake_test": LeftLake}


def register_all() -> None:
  for name, cls in NAMES.items():
    registry.register(name, cls, overwrite=True)


register_all()  # Worker processes that unpickle a class get the registrations too.
