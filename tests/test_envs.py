"""Tests of the text environments: action parsing, experts, robustness, sampler, registry, pool."""

import functools
import json
import math
import random
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eppo_jax import envs
from eppo_jax.envs import countdown as countdown_lib
from eppo_jax.envs.base import MAX_ACTION_CHARS, TextEnv, Transition

CORE_LEVELS = [(task, level) for task in envs.CORE_TASKS for level in ("easy", "medium", "hard")]
TEXTWORLD_LEVELS = [(task, level) for task in envs.TEXTWORLD_TASKS
                    for level in ("easy", "medium", "hard")]
needs_textworld = pytest.mark.skipif(not envs.textworld_available(),
                                     reason="textworld is not installed: pip install textworld")
INFO_KEYS = {"won", "invalid_action", "truncated", "steps"}

# --- action format -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("<action>up</action>", "up"),
    ("I think... <action> left </action>", "left"),
    ("<ACTION>Down</Action>", "Down"),
    ("<action>up</action> then <action>right</action>", "right"),
    ("<action>go north", "go north"),  # Cut off before the closing tag.
    ("<action>a<action>b</action></action>", "b"),
    ("< action >x</ action >", "x"),
    ("<action></action>", None),
    ("<action>   </action>", None),
    ("no tags here", None),
    ("", None),
    (None, None),
    ("</action>up<action>", None),
])
def test_parse_action(text, expected):
  assert envs.parse_action(text) == expected


def test_format_action_round_trips():
  for action in ["up", "go north", "(3+5)*7", "take coin from table"]:
    assert envs.parse_action(envs.format_action(action)) == action


def test_parse_action_handles_a_huge_reply_quickly():
  text = "<action" * 200_000 + "<action>up</action>" + "x" * 1_000_000
  start = time.perf_counter()
  assert envs.parse_action(text) == "up"
  assert time.perf_counter() - start < 2.0


# --- experts -------------------------------------------------------------------------------------


def _expert_wins(env: TextEnv, seed: int) -> bool:
  episode = envs.play(env, seed)
  assert episode.invalid_actions == 0, (env.spec, seed, episode.actions)
  return episode.won


@pytest.mark.parametrize("task, level", [tl for tl in CORE_LEVELS if tl != ("frozenlake", "hard")])
def test_expert_solves_core_levels(task, level):
  env = envs.make(task, level=level)
  wins = sum(_expert_wins(env, seed) for seed in range(200))
  assert wins >= 198, f"{task}:{level} expert won {wins}/200"


def test_slippery_expert_matches_optimal_success_rate():
  """Slips make success random: the expert's win rate must match the optimum's expected rate."""
  env = envs.make("frozenlake:hard")
  assert env.config.slippery
  optimal, wins = [], 0
  for seed in range(200):
    env.reset(seed)
    optimal.append(env.success_probability())
    wins += _expert_wins(env, seed)
  expected = float(np.mean(optimal))
  sigma = math.sqrt(sum(p * (1 - p) for p in optimal)) / len(optimal)
  assert abs(wins / 200 - expected) <= 4 * sigma + 0.01, (wins, expected)
  assert expected > 0.4  # Hard, yet a learner can still win often.


def test_slippery_plan_replays_exactly():
  """The slips are seeded by the instance, so a plan replays to the same outcome."""
  env = envs.make("frozenlake:hard")
  for seed in range(20):
    env.reset(seed)
    plan = env.solve()
    first = envs.play(env, seed, plan)
    second = envs.play(env, seed, plan)
    assert first.observations == second.observations


def test_levels_get_harder():
  """Expert solutions get longer (or the task bigger) from easy to hard."""
  for task in ("sokoban", "countdown"):
    sizes = []
    for level in ("easy", "medium", "hard"):
      env = envs.make(task, level=level)
      lengths = []
      for seed in range(30):
        env.reset(seed)
        plan = env.solve()
        lengths.append(len(plan) if task == "sokoban" else len(plan[0]))
      sizes.append(np.mean(lengths))
    assert sizes[0] < sizes[1] < sizes[2], (task, sizes)


def test_sokoban_solution_is_shortest():
  from eppo_jax.envs.sokoban import solve_bfs
  env = envs.make("sokoban:medium")
  for seed in range(20):
    env.reset(seed)
    plan = env.solve()
    assert solve_bfs(env.room, len(plan) - 1) is None


@pytest.mark.parametrize("expression, value", [
    ("(3+5)*7", 56), ("7*(5+3)", 56), ("8/2", None), ("3 × 5 + 7", 22), ("(3+5)*7 = 56", 56)])
def test_countdown_evaluator(expression, value):
  numbers = [3, 5, 7, 8]
  if value is None:  # 2 is not among the numbers.
    with pytest.raises(countdown_lib.InvalidExpression):
      countdown_lib.evaluate(expression, numbers)
  else:
    assert countdown_lib.evaluate(expression, numbers) == value


@pytest.mark.parametrize("expression", [
    "3+3", "7/3", "2**3", "-3+8", "__import__('os')", "abs(3)", "3.0+5", "[3]", "3 if 5 else 7",
    "8/(5-5)", "True+3", "(" * 300 + "3" + ")" * 300, "3;5", "lambda: 3"])
def test_countdown_rejects_rule_breaking_expressions(expression):
  with pytest.raises(countdown_lib.InvalidExpression):
    countdown_lib.evaluate(expression, [3, 5, 7, 8])


def test_countdown_solver_finds_an_exact_answer():
  assert countdown_lib.evaluate(countdown_lib.solve_countdown([2, 3, 7], 27), [2, 3, 7]) == 27
  assert countdown_lib.solve_countdown([2, 2], 99) is None


# --- protocol and robustness ---------------------------------------------------------------------


def _fresh_env(task: str, level: str = "easy") -> TextEnv:
  return envs.make(task, level=level)


@pytest.mark.parametrize("task", envs.CORE_TASKS)
def test_same_seed_gives_same_instance(task):
  a, b = _fresh_env(task), _fresh_env(task)
  for seed in (0, 7, 2**31 + 3):
    first, _ = a.reset(seed)
    a.step("up")
    assert b.reset(seed)[0] == first
    assert a.reset(seed)[0] == first
  assert len({a.reset(seed)[0] for seed in range(20)}) > 10


@pytest.mark.parametrize("task", envs.CORE_TASKS)
def test_protocol_basics(task):
  env = _fresh_env(task)
  assert env.instructions and "<action>" in env.instructions
  assert env.task_name == task and env.level == "easy" and env.spec == f"{task}:easy"
  with pytest.raises(RuntimeError):
    env.step("up")
  observation, info = env.reset(1)
  assert isinstance(observation, str) and observation
  assert INFO_KEYS <= set(info) and not info["won"]
  observation, reward, done, info = env.step(None)
  assert info["invalid_action"] and reward == envs.INVALID_ACTION_PENALTY
  for _ in range(env.max_steps):
    observation, reward, done, info = env.step(None)
    if done:
      break
  assert done and info["truncated"] and not info["won"]
  observation, reward, done, info = env.step("up")  # After the end: harmless, still done.
  assert done and reward == 0.0


def _garbage(rng: random.Random) -> str:
  pieces = ["<action>", "</action>", "<ACTION>", "< action >", "up", "down", "go north",
            "take coin", "(3+5)*7", "1/0", "**", "\x00", "\n", " ", "é", "日本語", "🙂", "\u202e",
            "<action><action>", "</action></action>", "left", "' OR 1=1", "{}", "%s", "\\"]
  kind = rng.randrange(5)
  if kind == 0:
    return "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
  if kind == 1:
    return "<action>" + "".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(rng.randrange(40)))
  if kind == 2:
    return "<action>" + rng.choice(pieces) * rng.choice([1, 10, 1000, 100_000]) + "</action>"
  if kind == 3:
    return rng.choice(["", " ", "<action>", "</action>", "<action></action>", "\x00" * 10])
  return envs.format_action(rng.choice(pieces) + rng.choice(pieces))


def _expected_invalid(env: TextEnv, action: str | None, admissible) -> bool:
  command = envs.normalize_action(action)
  if command is None:
    return True
  if env.task_name == "countdown":
    try:
      countdown_lib.evaluate(command, env.numbers)
    except countdown_lib.InvalidExpression:
      return True
    return False
  return command not in admissible


def _check_step(env: TextEnv, reply: str, seed: int) -> None:
  admissible = env.admissible_actions()
  action = envs.parse_action(reply)
  expected_invalid = _expected_invalid(env, action, admissible)
  observation, reward, done, info = env.step_text(reply)
  assert isinstance(observation, str) and isinstance(reward, float) and isinstance(done, bool)
  assert INFO_KEYS <= set(info)
  assert info["invalid_action"] == expected_invalid, (reply[:80], action)
  if expected_invalid:
    assert reward == envs.INVALID_ACTION_PENALTY
  if done:
    env.reset(seed)


@pytest.mark.parametrize("task", envs.CORE_TASKS)
def test_garbage_actions_never_crash(task):
  rng = random.Random(task)
  env = _fresh_env(task, "medium")
  env.reset(0)
  for i in range(300):
    _check_step(env, _garbage(rng), i)


@pytest.mark.parametrize("task", envs.CORE_TASKS)
def test_hypothesis_text_never_crashes(task):
  env = _fresh_env(task)
  env.reset(0)

  @settings(max_examples=60, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))
  @given(st.text(max_size=300), st.booleans())
  def check(text, wrap):
    _check_step(env, envs.format_action(text) if wrap else text, 0)

  check()


def test_over_long_action_is_invalid():
  env = _fresh_env("sokoban")
  env.reset(0)
  _, _, _, info = env.step("up" + " " * 10 + "x" * MAX_ACTION_CHARS)
  assert info["invalid_action"]


# --- sampler -------------------------------------------------------------------------------------


def test_sampler_state_round_trips_and_resumes():
  specs = {"sokoban:easy": 1.0, "countdown:hard": 2.0, "frozenlake:medium": 0.5}
  sampler = envs.TaskSampler(specs, seed=3)
  sampler.sample(17)
  state = json.loads(json.dumps(sampler.state_dict()))
  expected = [sampler.sample(8) for _ in range(3)]
  resumed = envs.TaskSampler(specs, seed=999)
  resumed.load_state_dict(state)
  assert [resumed.sample(8) for _ in range(3)] == expected


def test_sampler_draws_tasks_by_weight_with_training_seeds():
  sampler = envs.TaskSampler(["a", "b"], weights=[3.0, 1.0], seed=0)
  draws = sampler.sample(4000)
  share = np.mean([task == 0 for task, _ in draws])
  assert abs(share - 0.75) < 0.03
  assert all(0 <= seed < envs.EVAL_SEED_OFFSET for _, seed in draws)
  assert envs.TaskSampler(["a", "b"], seed=0).sample(5) == envs.TaskSampler(["a", "b"],
                                                                            seed=0).sample(5)
  assert envs.TaskSampler(["a", "b"], seed=0).sample(5) != envs.TaskSampler(["a", "b"],
                                                                            seed=1).sample(5)


def test_eval_seeds_are_fixed_and_disjoint_from_training():
  sampler = envs.TaskSampler(["a", "b"], seed=0, num_train_instances=50)
  train = {seed for _, seed in sampler.sample(1000)}
  held_out = envs.eval_seeds(100)
  assert held_out == envs.eval_seeds(100) and not train & set(held_out)
  assert sampler.eval_instances(2) == [(0, held_out[0]), (0, held_out[1]), (1, held_out[0]),
                                       (1, held_out[1])]


def test_sampler_rejects_bad_input():
  with pytest.raises(ValueError):
    envs.TaskSampler([])
  with pytest.raises(ValueError):
    envs.TaskSampler(["a"], weights=[-1.0])
  state = envs.TaskSampler(["a", "b"]).state_dict()
  with pytest.raises(ValueError, match="tasks"):
    envs.TaskSampler(["a", "c"]).load_state_dict(state)


def test_a_sampler_resumed_from_another_pool_draws_from_its_own():
  """A warm start's sampler state (all seeds) continues in a run on a fixed pool of 7 rooms."""
  state = envs.TaskSampler(["a", "b"], seed=1).state_dict()
  pooled = envs.TaskSampler(["a", "b"], seed=1, num_train_instances=7)
  pooled.load_state_dict(state)
  assert {seed for _, seed in pooled.sample(200)} == set(range(7))


# --- registry ------------------------------------------------------------------------------------


def test_registry_lists_and_makes_tasks():
  assert set(envs.CORE_TASKS) <= set(envs.list_tasks())
  assert envs.parse_task_spec("sokoban:hard") == ("sokoban", "hard")
  assert envs.parse_task_spec("countdown") == ("countdown", None)
  assert envs.make("sokoban:hard").level == "hard"
  assert envs.make("sokoban", level="medium").level == "medium"
  assert envs.make("countdown").level == "easy"
  assert envs.make("frozenlake:easy", max_steps=5).max_steps == 5
  assert envs.task_levels("sokoban") == ["easy", "medium", "hard"]


def test_registry_errors_name_the_valid_choices():
  with pytest.raises(KeyError) as error:
    envs.make("sokoban_deluxe:easy")
  for name in envs.list_tasks():
    assert name in str(error.value)
  with pytest.raises(ValueError, match="countdown"):  # Also a ValueError.
    envs.make("nope")
  with pytest.raises(ValueError, match="medium"):
    envs.make("sokoban:impossible")
  with pytest.raises(ValueError, match="twice"):
    envs.make("sokoban:easy", level="hard")
  with pytest.raises(ValueError, match="already registered"):
    envs.register("sokoban", envs.Sokoban)


class _Guess(TextEnv):
  """The docs' worked example: guess a number in [1, 10] with higher/lower hints."""
  task_name = "guess_test"
  LEVELS = {"easy": type("Level", (), {"max_steps": 6})}
  instructions = "Guess the number from 1 to 10. Reply like <action>5</action>."

  def _reset(self, seed):
    self.secret = random.Random(seed).randint(1, 10)
    return "Guess a number from 1 to 10."

  def _step(self, action):
    if not action.isdecimal():
      return self.invalid("Answer with a number.")
    guess = int(action)
    if guess == self.secret:
      return Transition("Correct!", 1.0, done=True, won=True)
    return Transition("Higher." if guess < self.secret else "Lower.", 0.0)

  def solve(self):
    return [str(self.secret)]


def test_a_new_task_registers_and_plays():
  envs.register(_Guess.task_name, _Guess, overwrite=True)
  env = envs.make("guess_test:easy")
  assert envs.play(env, 4).won
  assert envs.TaskSampler(["guess_test:easy", "sokoban:easy"]).num_tasks == 2


# --- pool ----------------------------------------------------------------------------------------


class _FlakyEnv(TextEnv):
  """Raises on about 10% of steps, or sleeps forever-ish when asked to."""
  task_name = "flaky_test"
  LEVELS = {"easy": type("Level", (), {"max_steps": 10**9})}

  def __init__(self, rng_seed, sleep_s=0.0):
    super().__init__()
    self.rng = random.Random(rng_seed)
    self.sleep_s = sleep_s

  def _reset(self, seed):
    return "start"

  def _step(self, action):
    if self.sleep_s:
      time.sleep(self.sleep_s)
    if self.rng.random() < 0.1:
      raise RuntimeError("engine crashed")
    return Transition(f"ok {action}", 1.0)

  def solve(self):
    return []


def test_pool_survives_failing_envs():
  pool = envs.EnvPool([_FlakyEnv(i) for i in range(8)], num_workers=4, timeout_s=10)
  pool.reset(list(range(8)))
  failures = 0
  for step in range(50):
    results = pool.step([f"a{i}" for i in range(8)])
    assert len(results) == 8
    for i, (observation, reward, done, info) in enumerate(results):
      if info.get("failed"):
        failures += 1
        assert done and "engine crashed" in info["error"] and "Traceback" in info["error"]
      else:
        assert observation == f"ok a{i}" and reward == 1.0
  assert failures == pool.num_failures
  assert 20 <= failures <= 70  # About 10% of 400 steps.
  pool.close()


def test_pool_times_out_a_hanging_env():
  hang = threading.Event()

  class Hanging(_FlakyEnv):
    def _step(self, action):
      hang.wait(5)
      return Transition("late", 0.0)

  envs_ = [_FlakyEnv(0), Hanging(1)]
  envs_[0].rng = random.Random(1)  # First draws are above 0.1: no random failure here.
  pool = envs.EnvPool(envs_, timeout_s=0.3)
  pool.reset([0, 0])
  start = time.perf_counter()
  (ok, timed_out) = pool.step(["x", "y"])
  assert time.perf_counter() - start < 3
  assert ok[0] == "ok x" and timed_out[3]["failed"] and "timed out" in timed_out[3]["error"]
  assert pool.step(["x"], indices=[1])[0][3]["failed"]  # Still busy: fails fast.
  assert pool.num_timeouts == 1 and pool.num_failures == 2
  hang.set()
  pool.close()


def test_pool_steps_real_envs_like_a_loop():
  specs = ["sokoban:easy", "countdown:easy", "frozenlake:easy"]
  pool = envs.EnvPool([envs.make(s) for s in specs])
  serial = [envs.make(s) for s in specs]
  assert [r[0] for r in pool.reset([1, 2, 3])] == [e.reset(s)[0] for e, s in zip(serial, [1, 2, 3])]
  plans = pool.map(lambda env: env.solve())
  results = pool.step([plan[0] for plan in plans])
  assert results == [env.step(plan[0]) for env, plan in zip(serial, plans)]
  pool.close()


class _SleepyEnv(_FlakyEnv):
  """Hangs on the action "hang"; otherwise a healthy env (module level, so workers can build it)."""

  def _step(self, action):
    if action == "hang":
      time.sleep(60)
    return Transition(f"ok {action}", 1.0)


def test_process_pool_survives_failures_and_kills_hung_workers():
  fns = [functools.partial(_FlakyEnv, i) for i in range(3)] + [functools.partial(_SleepyEnv, 0)]
  with envs.ProcessEnvPool(fns, num_workers=2, timeout_s=2.0) as pool:
    first = pool.reset([0, 1, 2, 3])
    assert all(not info.get("failed") for _, info in first), [i.get("error") for _, i in first]
    failures = 0
    for _ in range(20):
      results = pool.step(["a", "b", "c", "d"], indices=[0, 1, 2, 3])
      failures += sum(bool(info.get("failed")) for _, _, _, info in results)
      assert [r[0] for r in results if not r[3].get("failed")] == [
          f"ok {a}" for a, r in zip("abcd", results) if not r[3].get("failed")]
    assert failures == pool.num_failures and 1 <= failures <= 20  # ~10% of 60 flaky steps.
  sleepy = [functools.partial(_SleepyEnv, 0)] * 4
  with envs.ProcessEnvPool(sleepy, num_workers=2, timeout_s=2.0) as pool:
    pool.reset([0, 1, 2, 3])
    pool.step(["a", "b", "c", "d"])
    start = time.perf_counter()
    results = pool.step(["x", "y", "z", "hang"])  # Env 3 shares worker 1 with env 1.
    assert time.perf_counter() - start < 10
    assert "timed out" in results[3][3]["error"] and pool.num_timeouts == 1
    # The killed worker restarts; env 1 is replayed to where it was, env 3 needs a reset.
    after = pool.step(["y", "x", "w"], indices=[1, 0, 3])
    assert [r[0] for r in after[:2]] == ["ok y", "ok x"]
    assert [r[3]["steps"] for r in after[:2]] == [3, 3]
    assert "reset it" in after[2][3]["error"]
    pool.reset([5], indices=[3])
    assert pool.step(["v"], indices=[3])[0][0] == "ok v"


# --- TextWorld -----------------------------------------------------------------------------------


def test_textworld_missing_package_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "textworld", None)  # Makes `import textworld` fail.
  with pytest.raises(ImportError, match="pip install textworld"):
    envs.make("textworld_coin:easy")
  assert envs.default_suite() == ["sokoban:easy", "frozenlake:easy", "countdown:easy"]


@needs_textworld
@pytest.mark.parametrize("seed", [0, 900015])
@pytest.mark.parametrize("task, level", TEXTWORLD_LEVELS)
def test_textworld_expert_wins(task, level, seed):
  # Two games per level: generation takes seconds; games are cached under cache_root().
  env = envs.make(task, level=level)
  observation, _ = env.reset(seed)
  assert observation and "$$" not in observation
  plan = env.solve()
  assert len(plan) < env.max_steps
  for action in plan:
    assert action in env.admissible_actions()
    _, _, done, info = env.step(action)
  assert done and info["won"] and not info["invalid_action"]
  env.close()


@needs_textworld
def test_textworld_commands_match_in_any_case():
  """The game lists "take Comic Strip Calendar"; any casing of it is that command, and the
  engine gets the game's spelling (it wins)."""
  for spelling in (str.lower, str.upper, lambda c: c):
    env = envs.make("textworld_treasure:easy")
    env.reset(900015)
    plan = env.solve()
    assert any(c != c.lower() for c in plan), "the instance must have a capitalised command"
    for action in plan:
      _, _, done, info = env.step(spelling(action))
      assert not info["invalid_action"], action
    assert done and info["won"]
    env.close()


@needs_textworld
def test_textworld_same_seed_and_garbage():
  a, b = envs.make("textworld_coin:easy"), envs.make("textworld_coin:easy")
  assert a.reset(0)[0] == b.reset(0)[0]
  rng = random.Random(0)
  for i in range(80):
    if i % 4 == 0:
      reply = envs.format_action(rng.choice(a.admissible_actions()))
    else:
      reply = _garbage(rng)
    _check_step(a, reply, 0)
  a.close()
  b.close()


@needs_textworld
def test_pool_runs_textworld_games():
  games = [envs.make("textworld_coin:easy") for _ in range(3)]
  with envs.EnvPool(games, timeout_s=30) as pool:
    pool.reset([0, 0, 0])
    plans = pool.map(lambda env: env.solve())
    for t in range(len(plans[0])):
      results = pool.step([plan[t] for plan in plans])
    assert all(info["won"] for _, _, _, info in results)
    assert pool.num_failures == 0
