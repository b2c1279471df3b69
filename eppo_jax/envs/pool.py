"""Step many envs concurrently; a failing or hanging env yields a marker instead of an exception."""

from __future__ import annotations

import queue
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
  """Runs `reset`/`step` on a list of envs in threads (or inline), with a per-call timeout.

  Threads overlap engines that release the GIL, and envs need not be picklable. A failed or
  timed-out call returns a marker, `("", 0.0, True, failure_info(...))` for `step`,
  `("", failure_info(...))` for `reset`, so the batch goes on. Python cannot kill a thread: a
  timed-out call is abandoned (its env stays "busy", and further calls on it fail fast, until it
  returns) and a fresh thread takes its place, so the other calls of the batch still run. Every
  thread is a daemon that lives for one batch of calls, so an abandoned one never delays the
  interpreter's exit. A call stuck in C code that holds the GIL stalls the whole process: only
  `ProcessEnvPool` contains that.

  `num_workers=0` runs the calls one after another in the caller's thread: the cheapest way to
  step fast, trusted games (the grid games, Countdown), with the same failure markers but NO
  timeout, since nothing can interrupt the caller's own thread.
  """

  def __init__(self, envs: Sequence[TextEnv], num_workers: int | None = None,
               timeout_s: float = 60.0):
    self.envs = list(envs)
    self.timeout_s = float(timeout_s)
    self.num_workers = max(1, len(self.envs)) if num_workers is None else num_workers
    self._busy: set[int] = set()  # Envs whose (timed-out) call has not returned yet.
    self._lock = threading.Lock()
    self.num_failures = 0
    self.num_timeouts = 0
    self.num_abandoned_threads = 0  # Threads left behind in a timed-out call.

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
    if not self.num_workers:
      return [self._inline(fn, self.envs[i], on_failure) for i, fn in calls]
    results: list[Any] = [None] * len(calls)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    remaining = set()
    for pos, (i, _) in enumerate(calls):
      with self._lock:
        busy = i in self._busy
      if busy:
        results[pos] = self._fail(on_failure, f"env {i} is still running a timed-out call")
      else:
        todo.put(pos)
        remaining.add(pos)
    done: queue.SimpleQueue = queue.SimpleQueue()
    started: dict[int, float] = {}  # Position in `calls` -> start time, set by the worker.

    def work() -> None:
      while True:
        try:
          pos = todo.get_nowait()
        except queue.Empty:
          return
        i, fn = calls[pos]
        with self._lock:
          self._busy.add(i)
          started[pos] = time.monotonic()
        try:
          outcome = (True, fn(self.envs[i]))
        except Exception:  # The marker carries the traceback; the batch goes on.
          outcome = (False, traceback.format_exc())
        with self._lock:
          self._busy.discard(i)
        done.put((pos, outcome))

    def spawn() -> None:
      threading.Thread(target=work, name="env", daemon=True).start()

    for _ in range(min(self.num_workers, len(remaining))):
      spawn()
    while remaining:
      with self._lock:
        deadlines = [started[p] + self.timeout_s for p in remaining if p in started]
      wait_s = min(deadlines, default=time.monotonic() + 0.05) - time.monotonic()
      try:
        pos, (ok, value) = done.get(timeout=max(1e-3, wait_s))
        if pos in remaining:  # Not a call that already timed out.
          remaining.discard(pos)
          results[pos] = value if ok else self._fail(on_failure, value)
      except queue.Empty:
        pass
      now = time.monotonic()
      with self._lock:
        late = [p for p in remaining if p in started and now - started[p] > self.timeout_s]
      for pos in late:
        remaining.discard(pos)
        self.num_timeouts += 1
        self.num_abandoned_threads += 1
        results[pos] = self._fail(on_failure, f"timed out after {self.timeout_s:.1f}s")
        spawn()  # Replaces the stuck thread, so the queued calls still run.
    return results

  def _inline(self, fn: Callable, env: TextEnv, on_failure: Callable[[str], Any]) -> Any:
    try:
      return fn(env)
    except Exception:  # The marker carries the traceback; the batch goes on.
      return self._fail(on_failure, traceback.format_exc())

  def _fail(self, on_failure: Callable[[str], Any], error: str) -> Any:
    self.num_failures += 1
    return on_failure(error)

  def close(self) -> None:
    """Close the envs (an env still inside a timed-out call is left alone)."""
    with self._lock:
      busy = set(self._busy)
    for i, env in enumerate(self.envs):
      if i in busy:
        continue
      try:
        env.close()
      except Exception:  # Closing is best effort: a broken env must not block the others.
        pass

  def __enter__(self) -> "EnvPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
