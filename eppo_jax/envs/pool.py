"""Step many envs concurrently; a failing or hanging env yields a marker instead of an exception."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from eppo_jax.envs.base import TextEnv


def failure_info(error: str) -> dict:
  """The info dict of a failed call: the episode is over, unwon, with the error text."""
  return {"won": False, "invalid_action": False, "truncated": False, "steps": -1,
          "failed": True, "error": error}


class EnvPool:
  """Runs `reset`/`step` on a list of envs with a thread pool and a per-call timeout.

  Threads, not processes: TextWorld's game engine is a C library that releases the GIL, so
  threads overlap its work, while a process pool would have to pickle envs that hold live
  engines (see bench/envs.py for the measurement). A failed or timed-out call returns a marker,
  `("", 0.0, True, failure_info(...))` for `step`, `("", failure_info(...))` for `reset`, so the
  batch goes on. Python cannot kill a thread: a timed-out env stays "busy" (further calls on it
  fail fast) until its call returns, and a call that never returns also delays interpreter exit.

  `num_workers=0` runs the calls one after another in the caller's thread, with the same failure
  markers but no timeout: the cheapest way to step fast games (the grid games, Countdown).
  """

  def __init__(self, envs: Sequence[TextEnv], num_workers: int | None = None,
               timeout_s: float = 60.0):
    self.envs = list(envs)
    self.timeout_s = float(timeout_s)
    self.num_workers = max(1, len(self.envs)) if num_workers is None else num_workers
    self._executor = (cf.ThreadPoolExecutor(self.num_workers, thread_name_prefix="env")
                      if self.num_workers else None)
    self._busy: set[int] = set()
    self._lock = threading.Lock()
    self.num_failures = 0
    self.num_timeouts = 0

  def reset(self, seeds: Sequence[int], indices: Sequence[int] | None = None) -> list[tuple]:
    """`env.reset(seed)` for each selected env (default: all, in order)."""
    indices = range(len(self.envs)) if indices is None else indices
    calls = [(i, (lambda env, s=s: env.reset(s))) for i, s in zip(indices, seeds, strict=True)]
    return self._run(calls, lambda err: ("", failure_info(err)))

  def step(self, actions: Sequence[str | None],
           indices: Sequence[int] | None = None) -> list[tuple]:
    """`env.step(action)` for each selected env (default: all, in order)."""
    indices = range(len(self.envs)) if indices is None else indices
    calls = [(i, (lambda env, a=a: env.step(a))) for i, a in zip(indices, actions, strict=True)]
    return self._run(calls, lambda err: ("", 0.0, True, failure_info(err)))

  def map(self, fn: Callable[[TextEnv], Any], indices: Sequence[int] | None = None,
          default: Any = None) -> list[Any]:
    """`fn(env)` for each selected env; `default` where it fails (e.g. `solve` for demos)."""
    indices = range(len(self.envs)) if indices is None else indices
    return self._run([(i, fn) for i in indices], lambda err: default)

  def call(self, method: str, indices: Sequence[int] | None = None, default: Any = None) -> list:
    """`getattr(env, method)()` per env, e.g. "solve"; the same call as `ProcessEnvPool.call`."""
    return self.map(lambda env: getattr(env, method)(), indices, default)

  def _run(self, calls: list[tuple[int, Callable]], on_failure: Callable[[str], Any]) -> list:
    if self._executor is None:
      return [self._inline(fn, self.envs[i], on_failure) for i, fn in calls]
    results: list[Any] = [None] * len(calls)
    started: dict[int, float] = {}  # Position in `calls` -> start time, set by the worker thread.
    pending: dict[cf.Future, int] = {}
    for pos, (i, fn) in enumerate(calls):
      with self._lock:
        busy = i in self._busy
      if busy:
        results[pos] = self._fail(on_failure, f"env {i} is still running a timed-out call")
        continue
      pending[self._executor.submit(self._timed, started, pos, fn, self.envs[i])] = pos
    # A call still queued this long means the workers are stuck on timed-out calls.
    queue_deadline = time.monotonic() + self.timeout_s * (len(calls) // self.num_workers + 2)
    while pending:
      now = time.monotonic()
      waits = [started[p] + self.timeout_s - now for p in pending.values() if p in started]
      finished, _ = cf.wait(list(pending), timeout=max(0.0, min(waits, default=0.05)),
                            return_when=cf.FIRST_COMPLETED)
      for future in finished:
        pos = pending.pop(future)
        try:
          results[pos] = future.result()
        except Exception:  # The marker carries the traceback; the batch goes on.
          results[pos] = self._fail(on_failure, traceback.format_exc())
      now = time.monotonic()
      for future, pos in list(pending.items()):
        if pos in started and now - started[pos] > self.timeout_s:
          del pending[future]
          self._mark_busy(calls[pos][0], future)
          self.num_timeouts += 1
          results[pos] = self._fail(on_failure, f"timed out after {self.timeout_s:.1f}s")
        elif pos not in started and now > queue_deadline and future.cancel():
          del pending[future]
          self.num_timeouts += 1
          results[pos] = self._fail(on_failure, "never started: all workers are stuck")
    return results

  def _inline(self, fn: Callable, env: TextEnv, on_failure: Callable[[str], Any]) -> Any:
    try:
      return fn(env)
    except Exception:  # The marker carries the traceback; the batch goes on.
      return self._fail(on_failure, traceback.format_exc())

  @staticmethod
  def _timed(started: dict, pos: int, fn: Callable, env: TextEnv) -> Any:
    started[pos] = time.monotonic()
    return fn(env)

  def _mark_busy(self, i: int, future: cf.Future) -> None:
    with self._lock:
      self._busy.add(i)

    def release(_):
      with self._lock:
        self._busy.discard(i)
    future.add_done_callback(release)

  def _fail(self, on_failure: Callable[[str], Any], error: str) -> Any:
    self.num_failures += 1
    return on_failure(error)

  def close(self) -> None:
    """Stop the workers (does not wait for timed-out calls) and close the envs."""
    if self._executor is not None:
      self._executor.shutdown(wait=False, cancel_futures=True)
    for env in self.envs:
      try:
        env.close()
      except Exception:  # Closing is best effort: a broken env must not block the others.
        pass

  def __enter__(self) -> "EnvPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
