"""Countdown: reach a target from given numbers with + - * /, checked by a safe `ast` evaluator."""

from __future__ import annotations

import ast
import collections
import dataclasses
import operator
import random

from eppo_jax.envs.base import TextEnv, Transition, instance_rng

WIN_REWARD = 1.0


@dataclasses.dataclass(frozen=True)
class CountdownLevel:
  """How many numbers, their range, the target range, and attempts per episode."""
  count: int
  low: int
  high: int
  target_low: int
  target_high: int
  max_steps: int


LEVELS = {
    "easy": CountdownLevel(count=3, low=1, high=10, target_low=10, target_high=100, max_steps=3),
    "medium": CountdownLevel(count=4, low=1, high=20, target_low=20, target_high=300, max_steps=3),
    "hard": CountdownLevel(count=5, low=1, high=50, target_low=100, target_high=999, max_steps=3),
}

INSTRUCTIONS = """You are playing Countdown. Write an arithmetic expression that equals the target.
Use only the given numbers, each at most once, with + - * / and parentheses. Division must be exact.
If your answer is wrong you are told its value and may try again while attempts remain.
Reply with the expression only, for example <action>(3+5)*7</action>."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: None}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
# Accept the typographic operators a model may have seen in pretraining.
_TRANSLATE = str.maketrans({"×": "*", "x": "*", "÷": "/", "−": "-", "–": "-"})


class InvalidExpression(ValueError):
  """The answer breaks the rules (syntax, a number not given, inexact division...)."""


def evaluate(expression: str, numbers: list[int]) -> int:
  """The value of `expression`, which may use each of `numbers` at most once; never calls eval."""
  text = expression.translate(_TRANSLATE)
  if "=" in text:  # "(3+5)*7 = 56": judge the left side.
    text = text.split("=", 1)[0]
  try:
    tree = ast.parse(text.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise InvalidExpression("not an arithmetic expression") from e
  available = collections.Counter(numbers)

  def walk(node) -> int:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      left, right = walk(node.left), walk(node.right)
      if isinstance(node.op, ast.Div):
        if right == 0 or left % right:
          raise InvalidExpression(f"{left}/{right} is not an exact division")
        return left // right
      return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      if available[node.value] <= 0:
        raise InvalidExpression(f"{node.value} is not available")
      available[node.value] -= 1
      return node.value
    raise InvalidExpression("only numbers, + - * / and parentheses are allowed")

  return walk(tree.body)


def _combine(a: tuple[int, str], b: tuple[int, str]) -> list[tuple[int, str]]:
  """Every legal (value, expression) from two operands, in both orders where it matters."""
  (x, ex), (y, ey) = a, b
  out = [(x + y, f"({ex}+{ey})"), (x * y, f"({ex}*{ey})"), (x - y, f"({ex}-{ey})"),
         (y - x, f"({ey}-{ex})")]
  if y and x % y == 0:
    out.append((x // y, f"({ex}/{ey})"))
  if x and y % x == 0:
    out.append((y // x, f"({ey}/{ex})"))
  return out


def solve_countdown(numbers: list[int], target: int) -> str | None:
  """An expression with the fewest operations that equals `target`, or None if none exists."""
  start = [(n, str(n)) for n in numbers]
  for n in numbers:
    if n == target:
      return str(n)
  for ops in range(1, len(numbers)):
    found = _search(start, target, ops, set())
    if found is not None:
      return found[1:-1] if found.startswith("(") else found
  return None


def _search(items: list[tuple[int, str]], target: int, ops: int, seen: set) -> str | None:
  # Depth-limited search: `ops` more combinations; `seen` prunes value multisets already tried.
  key = (tuple(sorted(v for v, _ in items)), ops)
  if key in seen:
    return None
  seen.add(key)
  for i in range(len(items)):
    for j in range(i + 1, len(items)):
      rest = items[:i] + items[i + 1:j] + items[j + 1:]
      for value, expr in _combine(items[i], items[j]):
        if ops == 1:
          if value == target:
            return expr
        else:
          found = _search(rest + [(value, expr)], target, ops - 1, seen)
          if found is not None:
            return found
  return None


def generate(rng: random.Random, level: CountdownLevel) -> tuple[list[int], int]:
  """Numbers and a target built from a random expression over all of them, so one exists."""
  while True:
    numbers = [rng.randint(level.low, level.high) for _ in range(level.count)]
    values = list(numbers)
    while len(values) > 1:
      x = values.pop(rng.randrange(len(values)))
      y = values.pop(rng.randrange(len(values)))
      candidates = [v for v, _ in _combine((x, ""), (y, "")) if v > 0]
      values.append(rng.choice(candidates) if candidates else x + y)
    target = values[0]
    if level.target_low <= target <= level.target_high and target not in numbers:
      return numbers, target


class Countdown(TextEnv):
  """Each step is one attempt: +1 for an expression equal to the target (episode ends), 0 if
  it is a legal expression with another value (told the value, try again), the invalid
  penalty when it breaks the rules."""

  task_name = "countdown"
  LEVELS = LEVELS
  instructions = INSTRUCTIONS

  def __init__(self, level: str | None = None, max_steps: int | None = None):
    super().__init__(level, max_steps)
    self.numbers: list[int] = []
    self.target = 0

  def _reset(self, seed: int) -> str:
    self.numbers, self.target = generate(instance_rng(self.task_name, self.level, seed),
                                         self.config)
    return f"Numbers: {' '.join(map(str, self.numbers))}\nTarget: {self.target}"

  def _left(self) -> str:
    left = self.max_steps - self._steps
    return f"{left} attempt{'s' if left != 1 else ''} left."

  def _step(self, action: str) -> Transition:
    try:
      value = evaluate(action, self.numbers)
    except InvalidExpression as e:
      return self.invalid(f"Invalid: {e}. {self._left()}")
    if value == self.target:
      return Transition(f"Correct: {value} = {self.target}. You won!", WIN_REWARD, done=True,
                        won=True)
    return Transition(f"Wrong: that equals {value}, not {self.target}. {self._left()}", 0.0)

  def solve(self) -> list[str]:
    """One attempt: an expression with the fewest operations reaching the target."""
    return [solve_countdown(self.numbers, self.target)]
