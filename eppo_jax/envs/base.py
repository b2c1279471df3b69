"""The text-environment protocol every task implements, and the action format."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

# The model answers with one `<action>...</action>` block per turn.
ACTION_OPEN = "<action>"
ACTION_CLOSE = "</action>"
# Penalty for a turn whose action is unparseable, too long or not allowed by the game.
INVALID_ACTION_PENALTY = -0.1
# Longer "actions" are garbage for every task; refusing them early keeps game engines safe.
MAX_ACTION_CHARS = 256
# Shown to the model after an unparseable turn (one line, so short contexts survive it).
FORMAT_REMINDER = "Invalid reply: answer with exactly one <action>...</action> block."

_OPEN_TAG = re.compile(r"<\s*action\s*>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"<\s*/\s*action\s*>", re.IGNORECASE)


def action_span(text: str) -> tuple[int, int] | None:
  """[start, end) of the trimmed body of the last `<action>` block in `text`; None when there is
  no block or its body is empty."""
  last = None
  for last in _OPEN_TAG.finditer(text):
    pass
  if last is None:
    return None
  close = _CLOSE_TAG.search(text, last.end())
  # A reply cut off by the token budget often lacks the closing tag: take the rest of the text.
  body = text[last.end():close.start() if close else len(text)]
  start = last.end() + len(body) - len(body.lstrip())
  end = last.end() + len(body.rstrip())
  return (start, end) if end > start else None


def parse_action(text: Any) -> str | None:
  """The last `<action>` block of a model reply, trimmed; None when there is none."""
  span = action_span(text) if isinstance(text, str) else None
  return None if span is None else text[span[0]:span[1]]


def format_action(action: str) -> str:
  """The assistant text for an action, as expert demonstrations write it."""
  return f"{ACTION_OPEN}{action}{ACTION_CLOSE}"


def normalize_action(action: Any) -> str | None:
  """Lower-case, single-spaced action text; None when absent, empty or too long."""
  if not isinstance(action, str):
    return None
  action = " ".join(action.split()).lower()
  if not action or len(action) > MAX_ACTION_CHARS:
    return None
  return action


def instance_rng(task: str, level: str, seed: int) -> random.Random:
  """A generator that depends only on (task, level, seed), stable across runs and platforms."""
  # String seeds go through SHA-512 in `random`, independent of PYTHONHASHSEED.
  return random.Random(f"{task}/{level}/{int(seed)}")


@dataclasses.dataclass(frozen=True)
class Transition:
  """What a task's `_step` reports; the base class turns it into the public tuple."""
  observation: str
  reward: float = 0.0
  done: bool = False
  won: bool = False
  invalid: bool = False


class TextEnv:
  """Base class of every task: text observations in, parsed action strings out.

  Contract (what `agent.py` relies on):
    * `reset(seed) -> (observation, info)`: the same seed always gives the same instance and
      the same first observation, so a GRPO group of G episodes shares one instance.
    * `step(action) -> (observation, reward, done, info)` where `action` is the PARSED action,
      i.e. `parse_action(model_reply)`, or None when the reply had no `<action>` block.
      None, an over-long string, or an action the game does not allow is an ordinary step with
      reward `INVALID_ACTION_PENALTY` and `info["invalid_action"] = True`; it never raises.
      `step_text(reply)` does the parsing for callers that hold the raw reply.
    * `info` always has `won` (the task's own success verdict), `invalid_action`, `truncated`
      (the step limit ended the episode) and `steps`.
    * `solve()` right after `reset` gives an expert action list for that instance.
    * `instructions` is the system prompt: the task, the observation legend and the action format.

  Subclasses set `task_name`, `LEVELS`, `instructions` and implement `_reset`, `_step`, `solve`.
  """

  task_name: str = "base"
  LEVELS: dict[str, Any] = {}
  DEFAULT_LEVEL = "easy"
  instructions: str = ""
  invalid_penalty: float = INVALID_ACTION_PENALTY

  def __init__(self, level: str | None = None, max_steps: int | None = None):
    level = self.DEFAULT_LEVEL if level is None else level
    if level not in self.LEVELS:
      raise ValueError(f"unknown level {level!r} for task {self.task_name!r}; "
                       f"levels: {sorted(self.LEVELS)}")
    self.level = level
    self.config = self.LEVELS[level]
    self.max_steps = int(max_steps if max_steps is not None else self.config.max_steps)
    self.seed: int | None = None
    self._steps = 0
    self._done = False
    self._won = False

  @property
  def spec(self) -> str:
    """The task spec string, e.g. "sokoban:easy"."""
    return f"{self.task_name}:{self.level}"

  # --- public protocol -------------------------------------------------------------------------

  def reset(self, seed: int) -> tuple[str, dict]:
    """Start the instance `seed`; returns the first observation and an info dict."""
    self.seed = int(seed)
    self._steps, self._done, self._won = 0, False, False
    observation = self._reset(self.seed)
    return observation, self._info(invalid=False, truncated=False)

  def step(self, action: str | None) -> tuple[str, float, bool, dict]:
    """Apply one parsed action (None = unparseable); see the class docstring."""
    if self.seed is None:
      raise RuntimeError("call reset(seed) before step()")
    if self._done:
      return "The episode is over.", 0.0, True, self._info(invalid=True, truncated=False)
    self._steps += 1
    command = normalize_action(action)
    if command is None:
      result = self.invalid(FORMAT_REMINDER)
    else:
      result = self._step(command)
    self._won = self._won or result.won
    truncated = not (result.done or result.won) and self._steps >= self.max_steps
    self._done = result.done or result.won or truncated
    info = self._info(invalid=result.invalid, truncated=truncated)
    return result.observation, float(result.reward), self._done, info

  def step_text(self, reply: str) -> tuple[str, float, bool, dict]:
    """`step(parse_action(reply))`: for callers holding the raw model reply."""
    return self.step(parse_action(reply))

  def solve(self) -> list[str]:
    """Expert actions for the instance of the last `reset` (call it before stepping)."""
    raise NotImplementedError

  def admissible_actions(self) -> list[str] | None:
    """The actions the game accepts now, where the game has such a list; else None."""
    return None

  def close(self) -> None:
    """Release external resources (game processes, files)."""

  # --- for subclasses --------------------------------------------------------------------------

  def _reset(self, seed: int) -> str:
    raise NotImplementedError

  def _step(self, action: str) -> Transition:
    raise NotImplementedError

  def invalid(self, message: str) -> Transition:
    """The transition for an action the game does not accept: penalty, nothing changes."""
    return Transition(message, self.invalid_penalty, invalid=True)

  def _info(self, invalid: bool, truncated: bool) -> dict:
    return {"won": self._won, "invalid_action": invalid, "truncated": truncated,
            "steps": self._steps}

  def __repr__(self) -> str:
    return f"<{type(self).__name__} {self.spec} seed={self.seed}>"


@dataclasses.dataclass
class Episode:
  """One played episode: observations[0] is the reset text; one action/reward per step."""
  observations: list[str]
  actions: list[str]
  rewards: list[float]
  won: bool
  invalid_actions: int


def play(env: TextEnv, seed: int, actions: list[str] | None = None) -> Episode:
  """Reset to `seed` and play `actions` (default: the expert's) until done."""
  observation, _ = env.reset(seed)
  if actions is None:
    actions = env.solve()
  episode = Episode([observation], [], [], False, 0)
  for action in actions:
    observation, reward, done, info = env.step(action)
    episode.observations.append(observation)
    episode.actions.append(action)
    episode.rewards.append(reward)
    episode.invalid_actions += int(info["invalid_action"])
    episode.won = info["won"]
    if done:
      break
  return episode
