r"""EPPO's bounds replayed from a run's logged entropies: over all tokens, or over action tokens.

A run logs, per task and RL step, the mean entropy of its trained tokens (`entropy`, what the
default pacing reads) and of its action tokens alone (`action_entropy`). Replaying the pacing state
(`pacing.update_pacing`, `pacing.pacing_bounds`, the run's own method constants) over either series
gives the bounds EPPO set, and the ones `pacing.entropy_tokens="action"` would have set on the same
batches. The replay over `entropy` must reproduce the logged bounds (it is printed as a check).

  python bench/pacing_replay.py runs/default/seed0/eppo
  python bench/pacing_replay.py docs/data/default/seed*/eppo    # several runs: means over them
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eppo_jax import objective, pacing  # pylint: disable=g-import-not-at-top,wrong-import-position


def replay(records: list[dict], tasks: list[str], key: str, cfg: pacing.PacingConfig):
  """[steps, K] (eps_low, eps_high) that pacing sets from the logged `task/<t>/<key>` series; a
  task missing (or NaN) in a step's record counts as absent from that batch."""
  state, lows, highs = pacing.init_pacing(len(tasks)), [], []
  for r in records:
    ent = np.array([r.get(f"task/{t}/{key}", np.nan) for t in tasks], np.float64)
    present = np.isfinite(ent)
    state = pacing.update_pacing(state, jnp.asarray(np.where(present, ent, 0.0), jnp.float32),
                                 jnp.asarray(present.astype(np.int32)), cfg)
    low, high = pacing.pacing_bounds(state, cfg)
    lows.append(np.asarray(low))
    highs.append(np.asarray(high))
  return np.stack(lows), np.stack(highs)


def run_summary(workdir: Path) -> dict:
  """Per task: mean logged bound, mean replayed bound (all tokens, action tokens), entropies."""
  config = json.loads((workdir / "config.json").read_text())
  tasks = list(config["tasks"]["specs"])
  cfg, _ = objective.method_configs(config["method"], **config["pacing"]["overrides"])
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    records = [r for r in map(json.loads, f) if r["step"] > 0 and f"task/{tasks[0]}/eps_low" in r]
  logged = np.array([[r[f"task/{t}/eps_low"] for t in tasks] for r in records])
  out = {"tasks": tasks, "steps": len(records), "logged": logged.mean(0)}
  for key in ("entropy", "action_entropy"):
    low, _ = replay(records, tasks, key, cfg)
    out[key] = low.mean(0)
    out[f"{key}_mean"] = np.nanmean([[r.get(f"task/{t}/{key}", np.nan) for t in tasks]
                                     for r in records], axis=0)
  out["replay_error"] = float(np.abs(replay(records, tasks, "entropy", cfg)[0] - logged).max())
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", type=Path, help="finished RL runs (their records)")
  args = parser.parse_args(argv)
  runs = [run_summary(w) for w in args.workdirs]
  tasks = runs[0]["tasks"]
  mean = lambda key: np.mean([r[key] for r in runs], axis=0)
  print(f"{len(runs)} runs, {runs[0]['steps']} RL steps each; the replay of the logged bounds "
        f"differs from them by at most {max(r['replay_error'] for r in runs):.1e}")
  print("| task | entropy, all tokens | entropy, action tokens | ε (logged) | "
        "ε paced on all tokens | ε paced on action tokens |")
  print("|---|---|---|---|---|---|")
  for k, task in enumerate(tasks):
    print(f"| {task} | {mean('entropy_mean')[k]:.3f} | {mean('action_entropy_mean')[k]:.3f} | "
          f"{mean('logged')[k]:.3f} | {mean('entropy')[k]:.3f} | {mean('action_entropy')[k]:.3f} |")


if __name__ == "__main__":
  main()
