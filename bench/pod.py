r"""A pod on one machine: N processes x M CPU devices running the real trainer, with failures.

Each process is one "host" of a `jax.distributed` job on localhost (the project's
`config.distributed` fields), with `--xla_force_host_platform_device_count=M` CPU devices, running
`train.train` on the smoke preset with the `paced` task registered here: its episodes last
1 + seed % 4 turns, so hosts play different numbers of turns. Scenarios:

  agree   every host finishes; the records every host logged must be identical
  term    SIGTERM to one host during an RL step: every host stops at the next phase boundary,
          saves the same step and exits 143 (`--slow`: steps of several seconds, to time it)
  kill    kill -9 of one host during an RL step: every other host must stop within the bound
  raise   every environment reset fails on one host (its SFT demonstrations: a RuntimeError there)
  resume  `term`, then the same workdir resumed on another number of processes, to the end
  same    from one SFT checkpoint, `--steps` RL steps on 1 process x N*M devices and on N x M:
          the largest difference of the trained parameters

  python bench/pod.py --scenario agree --processes 4 --devices 2 --fsdp 8
  python bench/pod.py --scenario kill --processes 4 --devices 2
  python bench/pod.py --scenario resume --processes 2 --devices 2 --resume-processes 1
  python bench/pod.py --scenario term --steps 4 --after 2 --slow 1   # time SIGTERM -> saved

It prints one JSON line per scenario: what was injected, exit codes, seconds, agreement. The test
suite runs a small form (tests/test_pod.py); the larger form's numbers are in docs/scaling.md.
`launch` / `run_script` are also the one multi-process launcher of the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

# pylint: disable=g-import-not-at-top,wrong-import-position
from eppo_jax.envs import registry
from eppo_jax.envs.base import TextEnv, Transition
# pylint: enable=g-import-not-at-top,wrong-import-position

HOST_VAR = "EPPO_POD_HOST"  # This process's index, for the injected environment failures.
FAIL_VAR = "EPPO_POD_FAIL"  # "HOST:reset" (every reset raises there) or "HOST:step".
SLOW_VAR = "EPPO_POD_SLOW_S"  # Seconds each environment step of RL play sleeps: a slow RL step.


# ------------------------------------------------------------------------------------------------
# The task.


@dataclasses.dataclass(frozen=True)
class PacedLevel:
  max_steps: int = 4


def _failing(mode: str) -> bool:
  """Whether this process is the host told (by FAIL_VAR) to fail this way."""
  host, _, what = os.environ.get(FAIL_VAR, "").partition(":")
  return bool(host) and host == os.environ.get(HOST_VAR) and what == mode


class PacedTask(TextEnv):
  """Exactly 1 + seed % 4 turns per episode, whatever the replies; a turn answered with a number
  scores 1, anything else the invalid-action penalty. Built to end episodes after different
  numbers of turns on different hosts. FAIL_VAR makes one host's envs raise: at every reset, or
  at the second step of every seed that is a multiple of 3. Each step sleeps `slow_s`."""

  task_name = "paced"
  slow_s = 0.0  # host_main sets SLOW_VAR's value here while RL episodes play.
  LEVELS = {"easy": PacedLevel()}
  instructions = "Answer every round with a number, for example <action>3</action>."

  def _reset(self, seed: int) -> str:
    if _failing("reset"):
      raise RuntimeError(f"injected: every reset fails on host {os.environ[HOST_VAR]}")
    self._rounds, self._valid = 1 + seed % 4, True
    return self._ask()

  def _ask(self) -> str:
    return f"Round {self._steps + 1} of {self._rounds}. Say a number."

  def _step(self, action: str) -> Transition:
    return self._round(action.isdigit())

  def invalid(self, message: str) -> Transition:  # An unparseable reply also ends its round.
    return self._round(False)

  def _round(self, valid: bool) -> Transition:
    time.sleep(self.slow_s)
    if _failing("step") and self.seed % 3 == 0 and self._steps == 2:
      raise RuntimeError(f"injected: a step fails on host {os.environ[HOST_VAR]}")
    self._valid &= valid
    done = self._steps >= self._rounds
    return Transition(self._ask(), reward=1.0 if valid else self.invalid_penalty, done=done,
                      won=done and self._valid, invalid=not valid)

  def solve(self) -> list[str]:
    return [str((self.seed + i) % 10) for i in range(self._rounds)]


def register() -> None:
  registry.register("paced", PacedTask, overwrite=True)


register()


# ------------------------------------------------------------------------------------------------
# Launching processes.


def free_port() -> int:
  """A TCP port free on localhost now (for the coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(argv_of, n: int, log_dir: Path, devices: Optional[int] = None,
           env: Optional[dict] = None, cwd=None, xla_flags: str = "") -> list[subprocess.Popen]:
  """Starts `argv_of(i)` for i < n, each with its output in `log_dir/host{i}.log`.

  `devices` sets each process's CPU device count (XLA_FLAGS, followed by `xla_flags`); None leaves
  XLA_FLAGS to the script (removed from the inherited environment). Each process gets HOST_VAR =
  its index.
  """
  log_dir.mkdir(parents=True, exist_ok=True)
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  base.update(env or {})
  if devices is not None:
    base["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip()
  procs = []
  for i in range(n):
    log = open(log_dir / f"host{i}.log", "w")  # pylint: disable=consider-using-with
    procs.append(subprocess.Popen(argv_of(i), cwd=cwd, env={**base, HOST_VAR: str(i)},
                                  stdout=log, stderr=subprocess.STDOUT, text=True))
    log.close()  # The child holds its own descriptor.
  return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[Optional[int]]:
  """Exit codes once all have exited, or after `timeout_s` (None for those still running, which
  are then killed: a host left waiting in a collective never exits on its own)."""
  deadline = time.monotonic() + timeout_s
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  codes = [p.poll() for p in procs]
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  return codes


def log_text(log_dir: Path, i: int) -> str:
  return (log_dir / f"host{i}.log").read_text(errors="replace")


def run_script(script: Path, out_dir: Path, cwd, timeout_s: float, n: int = 2,
               devices: Optional[int] = None) -> list[dict]:
  """Runs `python script I OUT` as the n processes of one job; -> the JSON each wrote to its OUT.

  Fails with a process's last output if one exits non-zero or the time runs out.
  """
  outs = [out_dir / f"out{i}.json" for i in range(n)]
  procs = launch(lambda i: [sys.executable, str(script), str(i), str(outs[i])], n, out_dir,
                 devices, cwd=cwd)
  codes = wait_all(procs, timeout_s)
  for i, code in enumerate(codes):
    assert code == 0, f"process {i} exited {code}:\n{log_text(out_dir, i)[-5000:]}"
  return [json.loads(out.read_text()) for out in outs]


# ------------------------------------------------------------------------------------------------
# One host of the pod.


def smoke_config(**overrides):
  """The smoke preset with the pod's task; `overrides` are "section.field" -> value."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("multitask_config", ROOT / "configs/multitask.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke")
  config.tasks.specs = ("paced:easy",)
  config.tasks.env_backend = "inline"  # Trusted here; no worker processes on a shared CPU.
  config.rollout.max_turns = 4
  config.train.tensorboard = config.train.plots = config.train.export_hf = False
  for dotted, value in overrides.items():
    section, _, field = dotted.rpartition(".")
    node = config
    for name in section.split(".") if section else ():
      node = node[name]
    node[field] = value
  return config


def comparable(record: dict) -> dict:
  """A log record without its clock readings (times, throughput), which differ between hosts."""
  return {k: v for k, v in record.items() if not k.startswith("time") and "per_s" not in k}


def host_main(args) -> int:
  """One process: `train.train` with the pod's config; writes OUT (JSON) and its records."""
  import faulthandler  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  from eppo_jax import interrupt, metrics, train  # pylint: disable=g-import-not-at-top
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where is it stuck?
  logging.basicConfig(format=f"host {args.process_id} %(asctime)s %(name)s: %(message)s",
                      force=True)
  logging.getLogger("eppo_jax").setLevel(logging.INFO)
  config = smoke_config(**json.loads(args.overrides))
  if args.processes > 1:
    config.distributed.coordinator_address = f"127.0.0.1:{args.port}"
    config.distributed.num_processes = args.processes
    config.distributed.process_id = args.process_id
  out = Path(args.out)
  records = out.with_suffix(".records.jsonl")
  log = metrics.MetricsLogger.log

  def log_here(self, step, *rest, **kwargs):  # Every record this host logs, for the comparison.
    record = log(self, step, *rest, **kwargs)
    with records.open("a") as f:
      f.write(json.dumps(comparable(record)) + "\n")
    with records.with_suffix(".times").open("a") as f:  # When: for the durations of the steps.
      f.write(json.dumps([step, time.time()]) + "\n")
    return record

  metrics.MetricsLogger.log = log_here
  from eppo_jax import policy  # pylint: disable=g-import-not-at-top
  shrink, compactions = policy.ModelPolicy._maybe_compact, []

  def compact_here(self, cache, *rest):  # Counts the turns at which the batch shrank.
    rows = len(self._rows_R)
    out = shrink(self, cache, *rest)
    if len(self._rows_R) < rows:
      compactions.append([rows, len(self._rows_R)])
    return out

  policy.ModelPolicy._maybe_compact = compact_here
  play_step = train.Trainer.play_step

  def play_slowly(self, *args):  # RL play only: not the tokenizer corpus, SFT or evaluation.
    PacedTask.slow_s = float(os.environ.get(SLOW_VAR, 0))
    try:
      return play_step(self, *args)
    finally:
      PacedTask.slow_s = 0.0

  train.Trainer.play_step = play_slowly
  import jax  # pylint: disable=g-import-not-at-top
  try:
    record = train.train(config, args.workdir)
    result = dict(record=comparable(record))
    code = 0
  except interrupt.Interrupted as e:
    result, code = dict(interrupted=e.signum, message=str(e)), 128 + e.signum
  result.update(processes=jax.process_count(), devices=jax.device_count(),
                compactions=compactions)
  out.write_text(json.dumps(result))
  return code


# ------------------------------------------------------------------------------------------------
# The pod and its scenarios.


@dataclasses.dataclass
class Pod:
  """N host processes of one job on a shared workdir; `logs` holds each host's output."""

  processes: int
  devices: int
  workdir: Path
  logs: Path
  overrides: dict = dataclasses.field(default_factory=dict)
  fail: str = ""  # FAIL_VAR for every host: "HOST:reset" or "HOST:step".
  slow_s: float = 0.0  # SLOW_VAR for every host.
  xla_flags: str = ""  # More XLA_FLAGS for every host.
  procs: list = dataclasses.field(default_factory=list)
  exited: dict = dataclasses.field(default_factory=dict)  # host -> time.monotonic() at its exit.

  def start(self) -> "Pod":
    port = free_port()
    overrides = json.dumps(self.overrides)
    self.logs.mkdir(parents=True, exist_ok=True)
    for name in self.logs.glob("out*"):
      name.unlink()
    self.procs = launch(lambda i: [
        sys.executable, __file__, "host", "--process-id", str(i), "--processes",
        str(self.processes), "--port", str(port), "--workdir", str(self.workdir), "--out",
        str(self.logs / f"out{i}.json"), "--overrides", overrides], self.processes, self.logs,
                        self.devices, env={FAIL_VAR: self.fail, SLOW_VAR: str(self.slow_s)},
                        xla_flags=self.xla_flags)
    self.started = time.monotonic()
    return self

  def records(self, i: int) -> list[dict]:
    path = self.logs / f"out{i}.records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def step_seconds(self, i: int = 0) -> Optional[float]:
    """The median time between host i's records of consecutive RL steps (None: fewer than 2)."""
    path = self.logs / f"out{i}.records.times"
    times = dict(json.loads(line) for line in path.read_text().splitlines()) if path.exists() else {}
    gaps = [times[s] - times[s - 1] for s in times if s >= 2 and s - 1 in times]
    return round(float(sorted(gaps)[len(gaps) // 2]), 1) if gaps else None

  def out(self, i: int) -> Optional[dict]:
    path = self.logs / f"out{i}.json"
    return json.loads(path.read_text()) if path.exists() else None

  def log(self, i: int) -> str:
    return log_text(self.logs, i)

  def poll(self) -> bool:
    """Notes exit times; True while some host runs."""
    now = time.monotonic()
    for i, p in enumerate(self.procs):
      if i not in self.exited and p.poll() is not None:
        self.exited[i] = now
    return len(self.exited) < len(self.procs)

  def wait_until(self, done, timeout_s: float) -> bool:
    """Polls until `done()` or every host exited or the time ran out; -> done()."""
    deadline = time.monotonic() + timeout_s
    while self.poll() and not done() and time.monotonic() < deadline:
      time.sleep(0.2)
    return bool(done())

  def logged(self, step: int, i: int = 0) -> bool:
    """Host i logged the record of `step` (0: the last SFT step's, then the evaluation before
    the first RL step)."""
    return any(r["step"] >= step for r in self.records(i))

  def finish(self, timeout_s: float) -> list[Optional[int]]:
    """Waits for every host (killing those left after `timeout_s`) -> exit codes."""
    self.wait_until(lambda: False, timeout_s)
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    return [p.returncode for p in self.procs]

  def error_lines(self) -> list[str]:
    """Each host's lines that say why it stopped: ours, and jax.distributed's."""
    pattern = re.compile(r"^(error: host .*|.*Terminating process because.*)$", re.M)
    return [f"host {i}: " + "; ".join(m[:300] for m in pattern.findall(self.log(i)))
            for i in range(self.processes)]


def _summary(pod: Pod, codes, **extra) -> dict:
  return dict(processes=pod.processes, devices=pod.devices, fail=pod.fail, codes=codes,
              seconds=round(max(pod.exited.values(), default=pod.started) - pod.started, 1),
              **extra)


def agree(pod: Pod, timeout_s: float) -> dict:
  """Every host runs to the end; the records each logged must be identical."""
  codes = pod.start().finish(timeout_s)
  records = [pod.records(i) for i in range(pod.processes)]
  return _summary(pod, codes, identical=all(r == records[0] for r in records),
                  steps=[r["step"] for r in records[0]], final=(pod.out(0) or {}).get("record"))


def inject(pod: Pod, victim: int, signum: int, timeout_s: float, after: int = 0) -> dict:
  """`signum` to host `victim` once host 0 logged step `after` (so: during the next RL step);
  every host's exit code and seconds after it."""
  pod.start()
  if not pod.wait_until(lambda: pod.logged(after), timeout_s):
    codes = pod.finish(1)
    return _summary(pod, codes, error="the pod ended before RL began", lines=pod.error_lines())
  os.kill(pod.procs[victim].pid, signum)
  sent = time.monotonic()
  codes = pod.finish(timeout_s)
  after = {i: round(t - sent, 1) for i, t in sorted(pod.exited.items())}
  records = [pod.records(i) for i in range(pod.processes)]
  return _summary(pod, codes, injected=f"{signal.Signals(signum).name} to host {victim}",
                  seconds_after=after, step_s=pod.step_seconds(0),
                  last_step=[r[-1]["step"] if r else None for r in records],
                  identical=all(r == records[0] for r in records), lines=pod.error_lines(),
                  messages=[(pod.out(i) or {}).get("message") for i in range(pod.processes)])


def failing(pod: Pod, timeout_s: float) -> dict:
  """Runs with pod.fail set; how long the others took to stop after the first exit."""
  codes = pod.start().finish(timeout_s)
  first = min(pod.exited.values())
  return _summary(pod, codes, seconds_after_first_exit=round(max(pod.exited.values()) - first, 1),
                  lines=pod.error_lines())


def checkpoint_steps(workdir: Path) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").glob("[0-9]*"))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command")
  host = sub.add_parser("host", help="one host process (started by the pod)")
  host.add_argument("--process-id", type=int, required=True)
  host.add_argument("--processes", type=int, required=True)
  host.add_argument("--port", type=int, required=True)
  host.add_argument("--workdir", required=True)
  host.add_argument("--out", required=True)
  host.add_argument("--overrides", default="{}")
  parser.add_argument("--scenario", default="agree",
                      choices=("agree", "term", "kill", "raise", "resume", "same"))
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--fsdp", type=int, default=0, help="mesh.fsdp (0: every device)")
  parser.add_argument("--steps", type=int, default=3, help="RL steps")
  parser.add_argument("--victim", type=int, default=1, help="the host that is signalled / fails")
  parser.add_argument("--after", type=int, default=1,
                      help="term / kill: signal the victim once host 0 logged this RL step")
  parser.add_argument("--slow", type=float, default=0.0,
                      help="seconds each environment step sleeps (a slow RL step)")
  parser.add_argument("--resume-processes", type=int, default=1)
  parser.add_argument("--heartbeat", type=int, default=10, help="distributed.heartbeat_timeout_s")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per pod run")
  parser.add_argument("--dir", default="/tmp/eppo_pod", help="workdirs and logs")
  parser.add_argument("--set", nargs="*", default=[], help="more overrides, section.field=JSON")
  parser.add_argument("--xla-flags", default="", help="more XLA_FLAGS for every host")
  args = parser.parse_args(argv)
  if args.command == "host":
    sys.exit(host_main(args))
  base = Path(args.dir)
  tiny = base / "tiny_model"
  build_tiny_model(tiny)

  def pod(processes: int, name: str, fail: str = "") -> Pod:
    fsdp = args.fsdp or processes * args.devices
    # 2 instances (4 episodes) and 2 evaluation episodes per host at least: every host plays.
    overrides = {"model.tiny_dir": str(tiny), "mesh.data": -1, "mesh.fsdp": fsdp,
                 "train.num_steps": args.steps,
                 "rollout.instances_per_step": max(4, 2 * args.processes),
                 "train.eval_instances_per_task": max(4, 2 * args.processes),
                 "distributed.heartbeat_timeout_s": args.heartbeat,
                 **{k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)}}
    return Pod(processes, args.devices, base / name, base / name / "logs", overrides, fail,
               args.slow, xla_flags=args.xla_flags)

  import shutil  # pylint: disable=g-import-not-at-top
  name = f"{args.scenario}_{args.processes}x{args.devices}"
  shutil.rmtree(base / name, ignore_errors=True)
  if args.scenario == "agree":
    result = agree(pod(args.processes, name), args.timeout)
  elif args.scenario in ("term", "resume"):
    first = pod(args.processes, name)
    result = inject(first, args.victim, signal.SIGTERM, args.timeout, after=args.after)
    result["checkpoints"] = checkpoint_steps(first.workdir)
    if args.scenario == "resume":
      again = pod(args.resume_processes, name)
      again.logs = first.workdir / "logs_resumed"
      result["resumed"] = agree(again, args.timeout)
      result["resumed"]["from"] = re.findall(r"resumed from \S+ at RL step (\d+)",
                                             again.log(0))
  elif args.scenario == "same":
    result = same_update(pod, args, base / name)
  elif args.scenario == "kill":
    result = inject(pod(args.processes, name), args.victim, signal.SIGKILL, args.timeout,
                    after=args.after)
  else:
    result = failing(pod(args.processes, name, fail=f"{args.victim}:reset"), args.timeout)
  print(json.dumps({"scenario": args.scenario, **result}), flush=True)


def same_update(pod, args, base: Path) -> dict:
  """The same RL steps from the same checkpoint on 1 process x N*M devices and on N x M (fsdp over
  every device both times) -> the largest parameter difference after them."""
  import shutil  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  devices = args.processes * args.devices
  start = pod(1, "same")
  start.devices, start.workdir, start.logs = devices, base / "start", base / "start_logs"
  # A longer warm start than the smoke preset's: replies that differ, rewards that differ, a
  # gradient that is not zero.
  start.overrides.update({"train.num_steps": 0, "sft.steps": 40, "mesh.fsdp": devices})
  begun = agree(start, args.timeout)
  runs = {}
  for processes in (1, args.processes):
    run = pod(processes, "same")
    run.workdir, run.logs = base / f"run{processes}", base / f"run{processes}_logs"
    run.devices = devices // processes
    run.overrides.update({"sft.steps": 40, "mesh.fsdp": devices})
    shutil.copytree(start.workdir, run.workdir)
    runs[processes] = (run, agree(run, args.timeout))
  params = {p: trained_params(run.workdir, run.overrides) for p, (run, _) in runs.items()}
  one, many = params[1], params[args.processes]
  diff = max(float(np.max(np.abs(one[k] - many[k]))) for k in one)
  scale = max(float(np.max(np.abs(one[k]))) for k in one)
  return dict(start=dict(codes=begun["codes"], seconds=begun["seconds"]),
              runs={p: dict(codes=r["codes"], seconds=r["seconds"], identical=r["identical"],
                            grad_norm=[x.get("grad_norm") for x in run.records(0)])
                    for p, (run, r) in runs.items()},
              max_abs_diff=diff, max_abs_param=scale)


def trained_params(workdir: Path, overrides: dict) -> dict:
  """{path: NumPy array} of the trainable parameters in the workdir's latest checkpoint."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from eppo_jax import lora, programs, train  # pylint: disable=g-import-not-at-top
  from eppo_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  config = smoke_config(**overrides)
  _, params, _ = train.load_model(config, workdir)
  trainable, _ = lora.partition(params, lora.trainable_mask(params, full_finetune=True))
  like = programs.init_state(config, jax.tree_util.tree_map(np.asarray, trainable),
                             programs.optimizer(config))
  ckpt = Checkpointer(workdir / "checkpoints")
  state, _ = ckpt.restore(like)
  ckpt.close()
  flat = jax.tree_util.tree_flatten_with_path(state.trainable)[0]
  return {jax.tree_util.keystr(path): np.asarray(x, np.float64) for path, x in flat}


def build_tiny_model(directory: Path) -> None:
  """The smoke preset's tiny model for the pod's task, built once in this process."""
  from eppo_jax import train  # pylint: disable=g-import-not-at-top
  config = smoke_config(**{"model.tiny_dir": str(directory)})
  train.load_model(config, directory)


if __name__ == "__main__":
  main()
