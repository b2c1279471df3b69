"""Text environments for multi-turn agentic RL: protocol, tasks, registry, sampler, pools."""

from eppo_jax.envs.base import (ACTION_CLOSE, ACTION_OPEN, FORMAT_REMINDER, INVALID_ACTION_PENALTY,
                                MAX_ACTION_CHARS, Episode, TextEnv, Transition, format_action,
                                instance_rng, normalize_action, parse_action, play)
from eppo_jax.envs.countdown import Countdown
from eppo_jax.envs.frozenlake import FrozenLake
from eppo_jax.envs.pool import EnvPool, failure_info
from eppo_jax.envs.process_pool import ProcessEnvPool
from eppo_jax.envs.registry import (UnknownTaskError, list_tasks, make, parse_task_spec, register,
                                    task_levels)
from eppo_jax.envs.sampler import EVAL_SEED_OFFSET, TaskSampler, eval_seeds
from eppo_jax.envs.sokoban import Sokoban
from eppo_jax.envs.textworld_env import (CoinCollector, Cooking, TreasureHunter,
                                         textworld_available)

for _cls in (Sokoban, FrozenLake, Countdown, CoinCollector, TreasureHunter, Cooking):
  register(_cls.task_name, _cls, overwrite=True)  # overwrite: survives importlib.reload.

CORE_TASKS = ("sokoban", "frozenlake", "countdown")
TEXTWORLD_TASKS = (CoinCollector.task_name, TreasureHunter.task_name, Cooking.task_name)


def default_suite(levels: str | tuple[str, ...] = "easy") -> list[str]:
  """Built-in task specs at the given level(s); TextWorld joins when textworld is installed."""
  levels = (levels,) if isinstance(levels, str) else tuple(levels)
  tasks = CORE_TASKS + (TEXTWORLD_TASKS if textworld_available() else ())
  return [f"{task}:{level}" for task in tasks for level in levels]
