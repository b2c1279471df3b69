"""The default main job's RL step time at two commits, run back to back on the same machine.

  python bench/main_job.py --before <commit> --after <commit>              # 12 RL steps each
  python bench/main_job.py --before main~3 --after main --steps 20 --rounds 2 --cores 2
  python bench/main_job.py --before X --after Y --warm /tmp/main_job_kept/sft   # reuse an SFT

Each commit gets its own `git worktree` (a detached checkout in a temporary folder), and each run
is `python run.py --config=configs/multitask.py` in that checkout with `PYTHONPATH` set to it, so
each side imports its own `eppo_jax` (checked before the runs). The job is the tiny default: SFT
warm start, then `--steps` RL steps (`--config.train.num_steps`). With `--sft once` (the default)
the SFT stage runs once, at the `before` commit, with `num_steps=0`; each side then resumes a copy
of that workdir, so both start RL from the same policy and an exact change gives the same final
numbers. `--sft each` runs the whole job, SFT included, at each commit (use it when the two
commits' checkpoints are not compatible).

Reported per side: the mean of `time/step_s` over the RL steps in `metrics.jsonl` after the first
`--skip` ones (which include XLA compilation), its generation / environment / update split, the
ratio before / after (> 1: after is faster), and the final evaluation numbers. TensorBoard, plots
and the HF export are switched off: they run outside the timed step and only cost wall time.
`--rounds R` repeats the pair, alternating which side runs first, and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common

CONFIG = "configs/multitask.py"
# Off in every run: outside the timed RL step, they only lengthen the benchmark.
QUIET = ("--config.train.tensorboard=False", "--config.train.plots=False",
         "--config.train.export_hf=False")
SPLIT = ("time/step_s", "time/generation_s", "time/environment_s", "time/update_s")


def git(repo: Path, *args: str) -> str:
  return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                        check=True).stdout.strip()


def checkout(repo: Path, commit: str, where: Path) -> Path:
  """A detached worktree of `commit` at `where`."""
  git(repo, "worktree", "add", "--detach", str(where), commit)
  return where


def check_import(src: Path) -> None:
  """Fails unless a process with PYTHONPATH=src imports eppo_jax from src."""
  out = subprocess.run([sys.executable, "-c", "import eppo_jax; print(eppo_jax.__file__)"],
                       cwd=src, env=side_env(src), capture_output=True, text=True, check=True)
  path = Path(out.stdout.strip()).resolve()
  if src.resolve() not in path.parents:
    raise SystemExit(f"{src}: imports eppo_jax from {path}, not from its own checkout")


def side_env(src: Path) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = str(src)
  return env


def run_job(src: Path, workdir: Path, num_steps: int, extra, log: Path) -> float:
  """`python run.py` of the default config in checkout `src`; -> wall seconds."""
  cmd = [sys.executable, "run.py", f"--config={CONFIG}", f"--workdir={workdir}",
         f"--config.train.num_steps={num_steps}", *QUIET, *extra]
  # Every run compiles from scratch: a persistent XLA cache shared between runs would make the
  # later runs of a commit that has one look faster than its first.
  env = dict(side_env(src), JAX_COMPILATION_CACHE_DIR=str(workdir / "xla_cache"))
  start = time.time()
  with open(log, "w", encoding="utf-8") as f:
    proc = subprocess.run(cmd, cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
  if proc.returncode:
    tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
    raise SystemExit(f"{tail}\n{' '.join(cmd)} failed in {src} (exit {proc.returncode}); "
                     f"log: {log}")
  return time.time() - start


def step_times(workdir: Path, skip: int) -> dict:
  """Means of the RL steps' timings in metrics.jsonl, after the first `skip` RL steps."""
  records = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
  steps = [r for r in records if r.get("step", 0) >= 1 and r.get("time/step_s") is not None]
  kept = steps[skip:]
  if not kept:
    raise SystemExit(f"{workdir}: {len(steps)} RL steps logged, none left after --skip {skip}")
  out = {k: float(np.mean([r[k] for r in kept if r.get(k) is not None])) for k in SPLIT}
  out["steps"] = len(kept)
  return out


def final_numbers(workdir: Path) -> dict:
  """The final evaluation's numbers (greedy success and reward, overall and per task)."""
  record = json.loads((workdir / "final_metrics.json").read_text(encoding="utf-8"))
  return {k: v for k, v in record.items()
          if (k.startswith("eval_") or "/eval_success" in k) and v is not None}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--before", required=True, help="commit (or ref) of the old code")
  parser.add_argument("--after", required=True, help="commit (or ref) of the new code")
  parser.add_argument("--steps", type=int, default=12, help="RL steps per run")
  parser.add_argument("--skip", type=int, default=2,
                      help="first RL steps left out of the mean (XLA compilation)")
  parser.add_argument("--sft", default="once", choices=("once", "each"),
                      help="once: one SFT at --before, reused by both; each: SFT in every run")
  parser.add_argument("--warm", help="reuse this SFT workdir (from an earlier --keep run) instead "
                      "of training one; implies --sft once")
  parser.add_argument("--rounds", type=int, default=1, help="before/after pairs, order alternating")
  parser.add_argument("--cores", type=int, default=0,
                      help="cores for both runs (0 = all this process may use)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="FIELD=VALUE", help="extra config override for both runs, e.g. "
                      "--set rollout.instances_per_step=8 (repeatable)")
  parser.add_argument("--workdir", help="where the checkouts and runs go (default: a temp dir)")
  parser.add_argument("--keep", action="store_true", help="keep the checkouts and run folders")
  args = parser.parse_args()
  if args.steps <= args.skip:
    raise SystemExit(f"--steps {args.steps} must exceed --skip {args.skip}")

  cores = common.use_cores(args.cores)  # Both runs (child processes) inherit the mask.
  repo = Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
  shas = {side: git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}")
          for side, ref in (("before", args.before), ("after", args.after))}
  root = Path(args.workdir or tempfile.mkdtemp(prefix="main_job_")).resolve()
  root.mkdir(parents=True, exist_ok=True)
  extra = [f"--config.{o}" for o in args.overrides]
  srcs = {}
  try:
    for side, sha in shas.items():
      srcs[side] = checkout(repo, sha, root / f"{side}-src")
      check_import(srcs[side])
      print(f"{side}: {sha[:12]} {git(repo, 'log', '-1', '--format=%s', sha)[:70]}", flush=True)
    print(f"{cores} cores; {args.steps} RL steps per run, mean over steps {args.skip + 1}-"
          f"{args.steps}; SFT {args.sft}; {args.rounds} round(s); runs in {root}", flush=True)
    sft_dir = None
    if args.warm:
      sft_dir = Path(args.warm).resolve()
      print(f"SFT: reusing {sft_dir}", flush=True)
    elif args.sft == "once":
      sft_dir = root / "sft"
      wall = run_job(srcs["before"], sft_dir, 0, extra, root / "sft.log")
      print(f"SFT (at before, num_steps=0): {wall:.0f} s", flush=True)

    results = {"before": [], "after": []}
    for r in range(args.rounds):
      for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
        workdir = root / f"{side}-run{r}"
        if sft_dir is not None:
          shutil.copytree(sft_dir, workdir)
        wall = run_job(srcs[side], workdir, args.steps, extra, root / f"{side}-run{r}.log")
        times = step_times(workdir, args.skip)
        times.update(wall=wall, final=final_numbers(workdir))
        results[side].append(times)
        print(f"  round {r + 1}: {side} step {times['time/step_s']:.2f} s ({wall:.0f} s wall)",
              flush=True)
  finally:
    if not args.keep:
      for src in srcs.values():
        git(repo, "worktree", "remove", "--force", str(src))
      shutil.rmtree(root, ignore_errors=True)

  print(f"\n{'':>7} {'step s':>7} {'generate s':>10} {'env s':>6} {'update s':>8} "
        f"{'run wall s':>10}   (medians over rounds of each run's mean)")
  med = {side: {k: float(np.median([t[k] for t in results[side]])) for k in (*SPLIT, "wall")}
         for side in results}
  for side, m in med.items():
    print(f"{side:>7} {m['time/step_s']:7.2f} {m['time/generation_s']:10.2f} "
          f"{m['time/environment_s']:6.2f} {m['time/update_s']:8.2f} {m['wall']:10.0f}")
  print(f"ratio (before / after step time, > 1: after is faster): "
        f"{med['before']['time/step_s'] / med['after']['time/step_s']:.2f}x")
  print("\nfinal evaluation (first round):")
  finals = {side: results[side][0]["final"] for side in results}
  for key in sorted(set(finals["before"]) | set(finals["after"])):
    b, a = finals["before"].get(key), finals["after"].get(key)
    same = "same" if b == a else "differs"
    print(f"  {key:>44}: before {b}  after {a}  ({same})")


if __name__ == "__main__":
  main()
