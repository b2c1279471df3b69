"""Task registry: names to env factories, and task spec strings like "sokoban:easy"."""

from __future__ import annotations

import functools
from typing import Callable

from eppo_jax.envs.base import TextEnv

_FACTORIES: dict[str, Callable[..., TextEnv]] = {}


class UnknownTaskError(KeyError, ValueError):
  """A task name that is not registered (catchable as KeyError or ValueError)."""

  def __str__(self) -> str:  # KeyError would print the message with quotes around it.
    return str(self.args[0])


def _unknown(name: str) -> UnknownTaskError:
  return UnknownTaskError(f"unknown task {name!r}; registered tasks: {', '.join(list_tasks())}")


def register(name: str, factory: Callable[..., TextEnv], overwrite: bool = False) -> None:
  """Make `factory(level=..., **kwargs)` available as task `name`."""
  if ":" in name or not name:
    raise ValueError(f"task names must be non-empty and free of ':', got {name!r}")
  if name in _FACTORIES and not overwrite:
    raise ValueError(f"task {name!r} is already registered (pass overwrite=True to replace it)")
  _FACTORIES[name] = factory


def list_tasks() -> list[str]:
  """Every registered task name, sorted."""
  return sorted(_FACTORIES)


def parse_task_spec(spec: str) -> tuple[str, str | None]:
  """"sokoban:easy" -> ("sokoban", "easy"); "sokoban" -> ("sokoban", None), the default level."""
  name, _, level = spec.strip().partition(":")
  return name.strip(), (level.strip() or None)


def make(spec: str, level: str | None = None, **kwargs) -> TextEnv:
  """A new env for a task name or spec; `level` may come in the spec or as an argument."""
  name, spec_level = parse_task_spec(spec)
  if spec_level is not None and level is not None and spec_level != level:
    raise ValueError(f"level given twice: {spec!r} and level={level!r}")
  if name not in _FACTORIES:
    raise _unknown(name)
  return _FACTORIES[name](level=spec_level or level, **kwargs)


def factory(spec: str) -> Callable[[], TextEnv]:
  """A zero-argument factory of `make(spec)` that pickles (for worker processes) when the
  registered factory does, e.g. a class defined at module level."""
  name, level = parse_task_spec(spec)
  if name not in _FACTORIES:
    raise _unknown(name)
  return functools.partial(_FACTORIES[name], level=level)


def task_levels(name: str) -> list[str]:
  """The level names a registered task offers (its factory's LEVELS, when it has them)."""
  name = parse_task_spec(name)[0]
  if name not in _FACTORIES:
    raise _unknown(name)
  return list(getattr(_FACTORIES[name], "LEVELS", {}))
