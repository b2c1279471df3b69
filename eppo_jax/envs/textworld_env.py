"""TextWorld games (coin collector, treasure hunter, cooking), generated locally and cached."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from eppo_jax.envs.base import TextEnv, Transition, normalize_action

# TextWorld parses games with a global parser that is not thread-safe: generating, loading and
# resetting games take this lock (stepping does not need it).
_TEXTWORLD_LOCK = threading.RLock()
INSTALL_HINT = "TextWorld tasks need the textworld package: pip install textworld"


@dataclasses.dataclass(frozen=True)
class TextWorldLevel:
  """A `textworld.challenges` name with its settings, and the episode step limit."""
  challenge: str
  settings: tuple  # Sorted (key, value) pairs, so the level is hashable and prints stably.
  max_steps: int


def _cooking(**skills) -> tuple:
  settings = {"recipe": 1, "take": 0, "go": 1, "open": False, "cook": False, "cut": False,
              "drop": False, "recipe_seed": 0, "split": None}
  settings.update(skills)
  return tuple(sorted(settings.items()))


# Coin collector: level L has quest length (L-1) % 100 + 1; levels above 100 add distractor rooms.
COIN_LEVELS = {
    "easy": TextWorldLevel("tw-coin_collector", (("level", 2),), max_steps=10),
    "medium": TextWorldLevel("tw-coin_collector", (("level", 5),), max_steps=20),
    "hard": TextWorldLevel("tw-coin_collector", (("level", 110),), max_steps=30),
}
# Treasure hunter: levels 1-10 open rooms, 11-20 closed doors and containers, 21-30 locked ones.
TREASURE_LEVELS = {
    "easy": TextWorldLevel("tw-treasure_hunter", (("level", 3),), max_steps=10),
    "medium": TextWorldLevel("tw-treasure_hunter", (("level", 13),), max_steps=20),
    "hard": TextWorldLevel("tw-treasure_hunter", (("level", 23),), max_steps=30),
}
# Cooking: ingredients in the recipe, ingredients to fetch, rooms, and the skills needed.
COOKING_LEVELS = {
    "easy": TextWorldLevel("tw-cooking", _cooking(recipe=1, take=1, go=1), max_steps=15),
    "medium": TextWorldLevel("tw-cooking", _cooking(recipe=2, take=2, go=6, open=True),
                             max_steps=30),
    "hard": TextWorldLevel("tw-cooking", _cooking(recipe=3, take=3, go=6, open=True, cook=True,
                                                  cut=True), max_steps=50),
}

INSTRUCTIONS = """You are playing a text adventure game. Read the objective and each observation, then type one command, such as "go north", "open door", "take coin" or "inventory".
Commands must be written exactly as in the list of valid commands when one is shown.
Reply with exactly one command, for example <action>go north</action>."""

COOKING_INSTRUCTIONS = """You are playing a text adventure game: cook the recipe in the cookbook, then eat the meal.
Commands look like: examine cookbook, inventory, look, go east, open fridge, take carrot from fridge, take knife, slice carrot with knife, cook carrot with stove, prepare meal, eat meal.
Reply with exactly one command, for example <action>examine cookbook</action>."""


def textworld_available() -> bool:
  """Whether the optional textworld package can be imported."""
  try:
    import textworld  # noqa: F401
  except ImportError:
    return False
  return True


def _require_textworld():
  try:
    import textworld
  except ImportError as e:
    raise ImportError(INSTALL_HINT) from e
  return textworld


def cache_root() -> Path:
  """Where generated games live: $EPPO_JAX_CACHE/textworld, default ~/.cache/eppo_jax/textworld."""
  return Path(os.environ.get("EPPO_JAX_CACHE", "~/.cache/eppo_jax")).expanduser() / "textworld"


def game_file(task: str, level: str, seed: int, cache_dir: Path | None = None) -> Path:
  """The compiled game for (task, level, seed), generating and caching it on first use."""
  textworld = _require_textworld()
  config = TASK_LEVELS[task][level]
  root = Path(cache_dir) if cache_dir is not None else cache_root()
  # The settings' digest in the name keeps games of an edited level definition apart.
  digest = hashlib.sha1(repr((config.challenge, config.settings)).encode()).hexdigest()[:8]
  path = root / f"{task}-{level}-{int(seed)}-{digest}.z8"
  if path.exists():
    return path
  import textworld.challenges
  from textworld.generator.game import GameOptions
  root.mkdir(parents=True, exist_ok=True)
  _quiet_textworld()  # Generation plays the walkthrough to check it.
  # Build in a private folder and move into place, so concurrent processes never read half a
  # game; the lock also keeps threads apart, as some challenges reseed a global generator.
  with _TEXTWORLD_LOCK, tempfile.TemporaryDirectory(dir=root, prefix=".gen-") as tmp:
    if path.exists():
      return path
    options = GameOptions()
    options.seeds = int(seed)
    options.path = str(Path(tmp) / "game.z8")
    make_game = textworld.challenges.CHALLENGES[config.challenge][1]
    game = make_game(dict(config.settings), options)
    compiled = Path(textworld.generator.compile_game(game, options))
    shutil.move(str(compiled.with_suffix(".json")), str(path.with_suffix(".json")))
    os.replace(compiled, path)
  return path


# Lines of the ASCII-art title, blank lines, and the ">  -= Room =-0/3" prompt-and-status line.
_NOISE_LINE = re.compile(r"^([\s_\\|$/<>]*|>.*)$")


def clean_feedback(text: str) -> str:
  """Game text without the ASCII banner, the status line, end-of-game chatter and blank lines."""
  text = text.split("*** The End ***")[0]
  lines = [line.strip() for line in text.splitlines()]
  return "\n".join(line for line in lines if not _NOISE_LINE.match(line))


class TextWorldEnv(TextEnv):
  """One TextWorld challenge. Reward: the normalised score gain (a won game sums to 1)."""

  LEVELS: dict[str, TextWorldLevel] = {}
  instructions = INSTRUCTIONS

  def __init__(self, level: str | None = None, max_steps: int | None = None,
               list_commands: bool = True, cache_dir: str | None = None):
    _require_textworld()
    super().__init__(level, max_steps)
    # Showing the valid commands makes the game playable for small models.
    self.list_commands = list_commands
    self.cache_dir = cache_dir
    self.game = None
    self._state = None
    self._path: Path | None = None

  def _reset(self, seed: int) -> str:
    self._path = game_file(self.task_name, self.level, seed, self.cache_dir)
    self.close()
    with _TEXTWORLD_LOCK:
      self.game = _start(self._path)
      self._state = self.game.reset()
    return self._observe(clean_feedback(self._state.feedback))

  def _observe(self, feedback: str) -> str:
    if not self.list_commands or self._state.won or self._state.lost:
      return feedback
    return f"{feedback}\nValid commands: {', '.join(self.admissible_actions())}"

  def _step(self, action: str) -> Transition:
    # `action` arrives normalised (lower case, single spaces); the game lists commands in its own
    # spelling ("take Comic Strip Calendar"), and the engine gets that spelling.
    command = {normalize_action(c): c for c in self._state.admissible_commands}.get(action)
    if command is None:
      # Unknown commands never reach the game engine: it gets only text it can parse.
      return self.invalid(self._observe(f"'{action[:40]}' is not a valid command here."))
    score = self._state.score
    self._state, _, done = self.game.step(command)
    max_score = max(1, self._state.max_score or 1)
    reward = (self._state.score - score) / max_score
    feedback = clean_feedback(self._state.feedback)
    if self._state.won:
      feedback += "\nYou won!"
    elif self._state.lost:
      feedback += "\nYou lost."
    return Transition(self._observe(feedback), reward, done=bool(done or self._state.lost),
                      won=bool(self._state.won))

  def solve(self) -> list[str]:
    """The game's walkthrough, less the steps that are not valid commands when they come up."""
    if self._path not in _WALKTHROUGHS:
      _WALKTHROUGHS[self._path] = _admissible_walkthrough(self._path)
    return list(_WALKTHROUGHS[self._path])

  def admissible_actions(self) -> list[str] | None:
    if self._state is None:
      return None
    return sorted(self._state.admissible_commands)

  def close(self) -> None:
    if self.game is not None:
      self.game.close()
      self.game = None

  def __getstate__(self) -> dict[str, Any]:
    raise TypeError("a TextWorld env holds a live game engine and cannot be pickled")


def _quiet_textworld() -> None:
  # Jericho warns that it cannot track score in TextWorld games (TextWorld tracks it instead),
  # and big maps exhaust the grammar's adjectives (it reuses one): neither is actionable.
  warnings.filterwarnings("ignore", message=".*is not fully supported", module="jericho")
  warnings.filterwarnings("ignore", message="Not enough variation", module="textworld")


def _start(path: Path):
  import textworld
  _quiet_textworld()
  infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, max_score=True,
                             score=True, extras=["walkthrough"])
  return textworld.start(str(path), request_infos=infos)


# Cleaned walkthroughs by game file: replaying costs a game start, and games never change.
_WALKTHROUGHS: dict[Path, list[str]] = {}


def _admissible_walkthrough(path: Path) -> list[str]:
  """Replays the walkthrough on a private copy of the game, dropping no-op steps.

  Generated walkthroughs sometimes repeat a step that is already done ("open plain door" on an
  open door); the env refuses such commands as inadmissible, so the expert must not send them.
  """
  with _TEXTWORLD_LOCK:
    game = _start(path)
    state = game.reset()
  try:
    walkthrough, kept = list(state["extra.walkthrough"]), []
    for command in walkthrough:
      if command not in state.admissible_commands:
        continue
      kept.append(command)
      state, _, done = game.step(command)
      if done:
        break
    return kept if state.won else walkthrough
  finally:
    game.close()


class CoinCollector(TextWorldEnv):
  """Find the coin: tw-coin_collector."""
  task_name = "textworld_coin"
  LEVELS = COIN_LEVELS


class TreasureHunter(TextWorldEnv):
  """Find the named object: tw-treasure_hunter."""
  task_name = "textworld_treasure"
  LEVELS = TREASURE_LEVELS


class Cooking(TextWorldEnv):
  """Gather, prepare and eat a recipe: tw-cooking."""
  task_name = "textworld_cooking"
  LEVELS = COOKING_LEVELS
  instructions = COOKING_INSTRUCTIONS

  def __init__(self, level: str | None = None, max_steps: int | None = None,
               list_commands: bool = False, cache_dir: str | None = None):
    # Kitchens offer 30-60 valid commands: listing them every turn would fill a small context.
    super().__init__(level, max_steps, list_commands, cache_dir)


TASK_LEVELS = {cls.task_name: cls.LEVELS for cls in (CoinCollector, TreasureHunter, Cooking)}
