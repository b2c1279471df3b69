"""The record-reading benchmarks on the archived default runs (docs/data/default_sft): their
numbers against the same numbers read straight from the records."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "data" / "default_sft"
TASKS = ("sokoban:easy", "frozenlake:easy")


def _bench(script, *args) -> str:
  run = subprocess.run([sys.executable, str(ROOT / "bench" / script), *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  return run.stdout


def _evals(seed: int) -> dict[int, list[float]]:
  """{step: [eval success per task]} of one archived run (the warm start's step 0 included)."""
  out = {}
  for part in ("sft", "eppo"):
    for line in (RUNS / f"seed{seed}" / part / "metrics.jsonl").read_text().splitlines():
      r = json.loads(line)
      if "eval_success" in r:
        out[r["step"]] = [r[f"task/{t}/eval_success"] for t in TASKS]
  return out


def test_screen_reports_the_worst_task_gain_of_each_seed(tmp_path):
  text = _bench("screen.py", RUNS, "--method", "eppo", "--plot", tmp_path / "screen.png")
  for seed in (0, 1):
    evals = _evals(seed)
    want = min(evals[30]) - min(evals[0])  # The lower task at the end minus the lower at 0.
    got = float(re.search(rf"seed {seed} ([-+]?\d+\.\d+)", text).group(1))
    assert abs(got - want) < 6e-4, (seed, got, want)
  assert (tmp_path / "screen.png").stat().st_size > 0


def test_pacing_replay_reproduces_the_logged_bounds():
  text = _bench("pacing_replay.py", RUNS / "seed0" / "eppo")
  gap = float(re.search(r"differs from them by at most ([0-9.e+-]+)", text).group(1))
  assert gap < 1e-5
  # Its table's logged bound per task: the mean over steps of the records' own bounds.
  records = [json.loads(line) for line in
             (RUNS / "seed0" / "eppo" / "metrics.jsonl").read_text().splitlines()]
  for task in TASKS:
    logged = np.mean([r[f"task/{task}/eps_high"] for r in records if f"task/{task}/eps_high" in r])
    row = re.search(rf"\| {re.escape(task)} \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \|", text)
    assert abs(float(row.group(1)) - logged) < 6e-4, (task, row.group(1), logged)
