"""Envs living in worker processes: scales TextWorld over many cores, and can kill a hung engine."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import signal
import time
import traceback
from typing import Any, Callable, Sequence

from eppo_jax.envs.base import TextEnv
from eppo_jax.envs.pool import failure_info

EnvFn = str | Callable[[], TextEnv]  # A task spec for `make`, or a picklable env factory.


def _build(env_fn: EnvFn) -> TextEnv:
  if isinstance(env_fn, str):
    from eppo_jax.envs import make  # Importing the package registers the built-in tasks.
    return make(env_fn)
  return env_fn()


def _serve(conn, env_fns: dict[int, EnvFn]) -> None:
  """Worker loop: build the envs, say "ready", then answer (index, method, args) messages."""
  # Ctrl-C reaches the whole process group: the trainer decides when to stop, and closes us.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  envs: dict[int, TextEnv] = {}
  errors: dict[int, str] = {}
  for index, env_fn in env_fns.items():
    try:
      envs[index] = _build(env_fn)
    except Exception:  # Reported on every call to this env instead of killing the worker.
      errors[index] = traceback.format_exc()
  conn.send("ready")
  while True:
    message = conn.recv()
    if message is None:
      break
    index, method, args = message
    try:
      if index in errors:
        raise RuntimeError(f"building env {index} failed:\n{errors[index]}")
      reply = ("ok", getattr(envs[index], method)(*args))
    except Exception:  # The parent turns this into a failure marker.
      reply = ("error", traceback.format_exc())
    conn.send(reply)
  for env in envs.values():
    env.close()


class ProcessEnvPool:
  """Like `EnvPool`, but env i lives in worker process i % num_workers for its whole life.

  TextWorld spends about two thirds of a step in Python (its state tracking holds the GIL), so
  threads barely overlap it while processes scale with cores. Envs never cross process
  boundaries: give task specs ("textworld_coin:easy") or picklable zero-argument factories.
  A call past `timeout_s` kills its worker, whatever the call is doing (a loop in C that holds
  the GIL included); the worker restarts with fresh envs, and the other envs it held are brought
  back to where they were by replaying their seed and actions (envs are deterministic given both,
  see `TextEnv`), so only the env that hung fails; until it is reset, stepping it returns the
  failure marker. Workers are daemons, killed by `close`. Workers start with "forkserver"
  so they do not inherit the parent's threads (JAX's, for one); as with any non-fork start
  method, a script creating the pool must guard its entry point with
  `if __name__ == "__main__":` (workers re-import the main module).
  """

  def __init__(self, env_fns: Sequence[EnvFn], num_workers: int | None = None,
               timeout_s: float = 60.0, start_method: str = "forkserver",
               startup_timeout_s: float = 300.0):
    self.env_fns = list(env_fns)
    self.num_workers = max(1, min(num_workers or mp.cpu_count(), len(self.env_fns)))
    self.timeout_s = float(timeout_s)
    # Starting a worker imports the package and builds its envs: not counted as a call's time.
    self.startup_timeout_s = float(startup_timeout_s)
    self._context = mp.get_context(start_method)
    if start_method == "forkserver":
      self._context.set_forkserver_preload(["eppo_jax.envs"])
    self._workers: list[tuple[Any, Any]] = [self._spawn(w) for w in range(self.num_workers)]
    for w in range(self.num_workers):
      self._await_ready(w)
    self._needs_reset: set[int] = set()
    # [seed, actions so far, last result] of each env since its last good reset: a restart
    # replays the actions and checks that the last result comes back the same.
    self._history: dict[int, list] = {}
    self.num_failures = 0
    self.num_timeouts = 0

  def _spawn(self, worker: int):
    parent, child = self._context.Pipe()
    fns = {i: fn for i, fn in enumerate(self.env_fns) if i % self.num_workers == worker}
    process = self._context.Process(target=_serve, args=(child, fns), daemon=True)
    process.start()
    child.close()
    return process, parent

  def _await_ready(self, w: int) -> None:
    process, conn = self._workers[w]
    try:
      if conn.poll(self.startup_timeout_s) and conn.recv() == "ready":
        return
    except (EOFError, OSError):
      pass
    process.kill()
    raise RuntimeError(f"env worker {w} did not start within {self.startup_timeout_s:.0f}s "
                       f"(exit code {process.exitcode}); is the main module guarded?")

  def reset(self, seeds: Sequence[int], indices: Sequence[int] | None = None) -> list[tuple]:
    """`env.reset(seed)` in each selected env's worker (default: all envs, in order)."""
    indices = list(range(len(self.env_fns)) if indices is None else indices)
    results = self._run([(i, "reset", (int(s),)) for i, s in zip(indices, seeds, strict=True)],
                        lambda err: ("", failure_info(err)))
    for i, result in zip(indices, results):
      if not result[1].get("failed"):
        self._needs_reset.discard(i)
    return results

  def step(self, actions: Sequence[str | None],
           indices: Sequence[int] | None = None) -> list[tuple]:
    """`env.step(action)` in each selected env's worker (default: all envs, in order)."""
    indices = list(range(len(self.env_fns)) if indices is None else indices)
    calls = [(i, "step", (a,)) for i, a in zip(indices, actions, strict=True)]
    return self._run(calls, lambda err: ("", 0.0, True, failure_info(err)))

  def call(self, method: str, indices: Sequence[int] | None = None, default: Any = None) -> list:
    """`getattr(env, method)()` per env, e.g. "solve"; `default` where it fails."""
    indices = list(range(len(self.env_fns)) if indices is None else indices)
    return self._run([(i, method, ()) for i in indices], lambda err: default)

  def _run(self, calls: list[tuple[int, str, tuple]], on_failure: Callable[[str], Any]) -> list:
    results: list[Any] = [None] * len(calls)
    queues: dict[int, list[int]] = {w: [] for w in range(self.num_workers)}
    for pos, (i, _, _) in enumerate(calls):
      queues[i % self.num_workers].append(pos)
    in_flight: dict[int, tuple[int, float]] = {}  # worker -> (position in calls, start time)

    def send_next(w: int) -> None:
      while queues[w]:
        pos = queues[w].pop(0)
        i, method, _ = calls[pos]
        if method == "step" and i in self._needs_reset:  # Its worker restarted in this batch.
          results[pos] = self._fail(on_failure, f"env {i} was restarted after a failure; reset it")
          continue
        try:
          self._workers[w][1].send(calls[pos])
        except (BrokenPipeError, OSError):  # The worker died between calls.
          self._restart(w, culprit=i)
          results[pos] = self._fail(on_failure, f"worker {w} died; its envs were restarted")
          continue
        in_flight[w] = (pos, time.monotonic())
        return

    for w in range(self.num_workers):
      send_next(w)
    while in_flight:
      now = time.monotonic()
      wait_s = max(0.0, min(start + self.timeout_s - now for _, start in in_flight.values()))
      ready = mpc.wait([self._workers[w][1] for w in in_flight], timeout=wait_s)
      for w in list(in_flight):
        conn = self._workers[w][1]
        pos, start = in_flight[w]
        if conn in ready:
          try:
            status, value = conn.recv()
          except (EOFError, OSError):  # The worker died (e.g. a crash inside the C engine).
            status, value = "error", f"worker {w} died"
            self._restart(w, culprit=calls[pos][0])
          del in_flight[w]
          self._record(calls[pos], status == "ok", value)
          results[pos] = value if status == "ok" else self._fail(on_failure, value)
          send_next(w)
        elif time.monotonic() - start > self.timeout_s:
          del in_flight[w]
          self.num_timeouts += 1
          self._restart(w, culprit=calls[pos][0])
          results[pos] = self._fail(on_failure, f"timed out after {self.timeout_s:.1f}s")
          send_next(w)
    return results

  def _record(self, call: tuple[int, str, tuple], ok: bool, value: Any) -> None:
    """Keeps the replay history of env `i` up to date with a finished call."""
    i, method, args = call
    if method not in ("reset", "step"):
      return
    if not ok:
      self._history.pop(i, None)  # Its state is unknown: never replayed.
    elif method == "reset":
      self._history[i] = [args[0], [], value]
    elif i in self._history:
      self._history[i][1].append(args[0])
      self._history[i][2] = value

  def _restart(self, w: int, culprit: int | None = None) -> None:
    """Kill worker `w`, start a fresh one, and replay its envs other than `culprit`."""
    self._kill(w)
    self._workers[w] = self._spawn(w)
    self._await_ready(w)
    mine = [i for i in range(len(self.env_fns)) if i % self.num_workers == w]
    if culprit is not None:
      self._history.pop(culprit, None)
    for i in mine:
      if i in self._history and not self._replay(w, i):
        # Replaying hung or failed too: give up on this worker's envs rather than loop.
        self._kill(w)
        self._workers[w] = self._spawn(w)
        self._await_ready(w)
        for j in mine:
          self._history.pop(j, None)
        break
    self._needs_reset.update(i for i in mine if i not in self._history)

  def _replay(self, w: int, i: int) -> bool:
    """Reset env `i` in worker `w` to its seed and replay its actions; False if any call fails or
    the replay ends elsewhere than the original."""
    seed, actions, last = self._history[i]
    conn = self._workers[w][1]
    try:
      for method, args in [("reset", (seed,))] + [("step", (a,)) for a in actions]:
        conn.send((i, method, args))
        if not conn.poll(self.timeout_s):
          return False
        status, value = conn.recv()
        if status != "ok":
          return False
    except (EOFError, OSError):
      return False
    return value == last  # Else the env is not deterministic: its state cannot be trusted.

  def _kill(self, w: int) -> None:
    process, conn = self._workers[w]
    process.kill()
    process.join(5)
    conn.close()

  def _fail(self, on_failure: Callable[[str], Any], error: str) -> Any:
    self.num_failures += 1
    return on_failure(error)

  def close(self) -> None:
    """Ask the workers to close their envs and exit; kill those that do not."""
    for process, conn in self._workers:
      try:
        conn.send(None)
      except (BrokenPipeError, OSError):
        pass
    for process, conn in self._workers:
      process.join(5)
      if process.is_alive():
        process.kill()
      conn.close()
    self._workers = []

  def __enter__(self) -> "ProcessEnvPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
