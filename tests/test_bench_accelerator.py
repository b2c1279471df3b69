"""bench/accelerator.py at tiny sizes on the CPU: it runs end to end (update rows, then decode
rows on the same weights), its rows are the sweep it was asked for, and bad sweeps are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(tmp_path, *args):
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(BENCH / "accelerator.py"), *args], cwd=BENCH,
                        env=env, capture_output=True, text=True, timeout=600)


def test_tiny_sweep_writes_one_row_per_point(tmp_path):
  out = tmp_path / "acc.json"
  run = _run(tmp_path, "--models", "tiny", "--dtype", "float32", "--tokens", "256", "--seqs",
             "16,32", "--attention", "auto,blockwise", "--modes", "full", "--decode-batches", "2",
             "--prompt-len", "8", "--new-tokens", "4", "--steps", "1", "--json", str(out))
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(out.read_text())
  # "auto" is the blockwise kernel on a CPU: one kernel, so one row per sequence length.
  assert [(r["batch"], r["seq"], r["attention"]) for r in report["update"]] == [
      (16, 16, "blockwise"), (8, 32, "blockwise")]
  for row in report["update"]:
    assert row["step_s"] > 0 and row["peak_gib"] > 0 and 0 < row["mfu_measured"]
  (decode,) = report["decode"]
  assert decode["batch"] == 2 and decode["step_s"] > 0 and decode["bytes"] > 0


def test_sequence_lengths_that_do_not_make_whole_groups_are_refused(tmp_path):
  run = _run(tmp_path, "--models", "tiny", "--tokens", "64", "--seqs", "24")
  assert run.returncode == 2 and "--seqs: 24 must be >= 2 and divide --tokens=64" in run.stderr
  run = _run(tmp_path, "--models", "tiny", "--tokens", "64", "--seqs", "16")
  assert run.returncode == 2 and "4 sequences per step, not a multiple of 4" in run.stderr
