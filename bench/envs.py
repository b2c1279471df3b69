"""Environment throughput: steps/s per task and level, and serial vs thread vs process stepping.

  python bench/envs.py                      # every built-in task, ~1 s each
  python bench/envs.py --tasks sokoban:hard countdown:easy --seconds 3
  python bench/envs.py --pool               # also compare ways to step a batch of envs

Steps play random admissible actions (Countdown: the expert's answer or a random number pair),
resetting to a new instance when an episode ends; reset time (instance generation) is reported
separately, over 5 instances generated before timing: a TextWorld reset is a cached game's load,
and generating a new game costs another 1-5 s.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eppo_jax import envs  # noqa: E402


def _random_action(env: envs.TextEnv, rng: random.Random) -> str:
  admissible = env.admissible_actions()
  if admissible:
    return rng.choice(admissible)
  if env.task_name == "countdown":  # No action list: mix right and (mostly) wrong answers.
    if rng.random() < 0.3:
      return env.solve()[0]
    a, b = rng.sample(env.numbers, 2)
    return f"{a}{rng.choice('+-*/')}{b}"
  return "look"


def measure(spec: str, seconds: float, num_seeds: int = 5) -> dict:
  """Steps/s (stepping only) and resets/s over `num_seeds` instances of one task spec."""
  env = envs.make(spec)
  rng = random.Random(0)
  for seed in range(num_seeds):  # Generate TextWorld games outside the clock.
    env.reset(seed)
  steps = resets = episodes = 0
  step_time = reset_time = 0.0
  deadline = time.perf_counter() + seconds
  while time.perf_counter() < deadline:
    start = time.perf_counter()
    env.reset(resets % num_seeds)
    reset_time += time.perf_counter() - start
    resets += 1
    done = False
    while not done:
      action = _random_action(env, rng)
      start = time.perf_counter()
      _, _, done, _ = env.step(action)
      step_time += time.perf_counter() - start
      steps += 1
    episodes += 1
  env.close()
  return {"spec": spec, "steps_per_s": steps / max(step_time, 1e-9),
          "resets_per_s": resets / max(reset_time, 1e-9), "mean_len": steps / max(episodes, 1)}


def _drive(pool, num_envs: int, num_steps: int, rng: random.Random) -> float:
  """Steps/s of a pool playing random admissible actions, resetting envs whose episode ended."""
  pool.reset([0] * num_envs)
  admissible = pool.call("admissible_actions")
  start = time.perf_counter()
  for _ in range(num_steps):
    results = pool.step([rng.choice(a) if a else "look" for a in admissible])
    ended = [i for i, r in enumerate(results) if r[2]]
    if ended:
      pool.reset([0] * len(ended), indices=ended)
    admissible = pool.call("admissible_actions")
  return num_envs * num_steps / (time.perf_counter() - start)


def compare_pool(spec: str, num_envs: int, num_steps: int) -> dict:
  """Total steps/s of `num_envs` envs: a plain loop, EnvPool (threads), ProcessEnvPool."""
  rng = random.Random(0)
  games = [envs.make(spec) for _ in range(num_envs)]
  for game in games:
    game.reset(0)
  start = time.perf_counter()
  for _ in range(num_steps):
    for game in games:
      _, _, done, _ = game.step(rng.choice(game.admissible_actions()))
      if done:
        game.reset(0)
  result = {"serial": num_envs * num_steps / (time.perf_counter() - start)}
  with envs.EnvPool(games, timeout_s=60) as pool:
    result["thread"] = _drive(pool, num_envs, num_steps, rng)
  with envs.ProcessEnvPool([spec] * num_envs, timeout_s=60) as pool:
    result["process"] = _drive(pool, num_envs, num_steps, rng)
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", nargs="*", help="task specs (default: every task and level)")
  parser.add_argument("--seconds", type=float, default=1.0, help="time per task")
  parser.add_argument("--pool", action="store_true", help="also compare serial/thread/process")
  parser.add_argument("--pool-envs", type=int, default=4)
  parser.add_argument("--pool-steps", type=int, default=50)
  args = parser.parse_args()

  specs = args.tasks or envs.default_suite(("easy", "medium", "hard"))
  print(f"{'task':<28}{'steps/s':>12}{'resets/s':>12}{'mean ep len':>13}")
  for spec in specs:
    row = measure(spec, args.seconds)
    print(f"{row['spec']:<28}{row['steps_per_s']:>12,.0f}{row['resets_per_s']:>12,.1f}"
          f"{row['mean_len']:>13.1f}", flush=True)

  if args.pool:
    pool_specs = ["sokoban:medium"] + (["textworld_coin:medium"] if envs.textworld_available()
                                       else [])
    print(f"\nTotal steps/s, {args.pool_envs} envs x {args.pool_steps} steps "
          f"(cpus: {os.cpu_count()})")
    print(f"{'task':<28}{'serial':>10}{'thread':>10}{'process':>10}")
    for spec in pool_specs:
      row = compare_pool(spec, args.pool_envs, args.pool_steps)
      print(f"{spec:<28}{row['serial']:>10,.0f}{row['thread']:>10,.0f}{row['process']:>10,.0f}",
            flush=True)


if __name__ == "__main__":
  main()
