"""The evidence study's statistics: pure functions of run records and per-seed numbers.

A run's records are the dicts of its `metrics.jsonl` (`step`, `eval_success`,
`task/<spec>/<metric>`, ...). Nothing here reads files or imports JAX, so every number in the
study's report can be recomputed by hand from the logs.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

COLLAPSE_NATS = 0.05  # A task whose token entropy falls below this has collapsed.
MIN_SEEDS = 5  # The protocol's seeds (docs/results.md): no verdict is read from fewer.


def eval_curve(records: Sequence[dict], key: str = "eval_success") -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of the eval points (RL step >= 0) that carry `key`."""
  points = [(r["step"], r[key]) for r in records if r["step"] >= 0 and r.get(key) is not None]
  if not points:
    return np.zeros(0), np.zeros(0)
  steps, values = zip(*points)
  return np.asarray(steps, float), np.asarray(values, float)


def normalized_auc(steps: Sequence[float], values: Sequence[float]) -> float:
  """Trapezoid area under `values` over `steps`, divided by the step span: the run's mean level."""
  steps, values = np.asarray(steps, float), np.asarray(values, float)
  if steps.shape != values.shape or steps.ndim != 1 or len(steps) < 2:
    raise ValueError(f"need >= 2 matching points, got steps {steps.shape} values {values.shape}")
  if np.any(np.diff(steps) <= 0):
    raise ValueError("steps must increase strictly")
  widths = np.diff(steps)
  return float(np.sum(widths * (values[1:] + values[:-1]) / 2.0) / (steps[-1] - steps[0]))


def entropy_series(records: Sequence[dict], task: str) -> list[tuple[int, float]]:
  """(RL step, token entropy) of `task` for every RL step where the task was in the batch."""
  key = f"task/{task}/entropy"
  return [(r["step"], r[key]) for r in records if r["step"] > 0 and r.get(key) is not None]


def count_crossovers(records: Sequence[dict], tasks: Sequence[str]) -> int:
  """Task pairs whose entropy order flips between a step and each task's last observed entropy.

  The definition of `pacing.entropy_crossovers`, recomputed from the logged per-task entropies:
  a strict sign change of H_i - H_j, both tasks observed before and in this batch.
  """
  last = {}
  total = 0
  for r in sorted((r for r in records if r["step"] > 0), key=lambda r: r["step"]):
    now = {t: r[f"task/{t}/entropy"] for t in tasks if r.get(f"task/{t}/entropy") is not None}
    both = [t for t in tasks if t in now and t in last]
    for i, a in enumerate(both):
      for b in both[i + 1:]:
        total += int(np.sign(last[a] - last[b]) * np.sign(now[a] - now[b]) < 0)
    last.update(now)
  return total


def collapse_events(series: Sequence[tuple[int, float]], threshold: float = COLLAPSE_NATS) -> int:
  """How many times a task's entropy falls below `threshold` (the first step counts if below)."""
  events, above = 0, True
  for _, value in series:
    if value < threshold and above:
      events += 1
    above = value >= threshold
  return events


def per_100_steps(count: float, num_steps: int) -> float:
  """A count over `num_steps` RL steps as a rate per 100 steps."""
  if num_steps <= 0:
    raise ValueError(f"num_steps must be positive, got {num_steps}")
  return 100.0 * count / num_steps


def run_metrics(records: Sequence[dict], tasks: Sequence[str]) -> dict:
  """Every per-run number of the study's report, from one run's records."""
  steps, success = eval_curve(records)
  if len(steps) == 0:
    raise ValueError("the run has no eval point")
  per_task = {t: eval_curve(records, f"task/{t}/eval_success") for t in tasks}
  final_task = {t: float(v[-1]) for t, (_, v) in per_task.items()}
  auc_task = {t: normalized_auc(s, v) if len(s) > 1 else float(v[-1])
              for t, (s, v) in per_task.items()}
  rl = [r for r in records if r["step"] > 0]
  num_steps = max((r["step"] for r in rl), default=0)
  series = {t: entropy_series(records, t) for t in tasks}
  collapses = {t: collapse_events(s) for t, s in series.items()}
  out = {
      "rl_steps": num_steps,
      "start_success": float(success[0]),
      "final_success": float(success[-1]),
      "auc_success": normalized_auc(steps, success) if len(steps) > 1 else float(success[-1]),
      "worst_task_final": min(final_task.values()),
      "worst_task_auc": min(auc_task.values()),
      "per_task_final": final_task,
      "per_task_auc": auc_task,
      "collapse_events": sum(collapses.values()),
      "per_task_collapse_events": collapses,
      "entropy_end": {t: float(np.mean([v for _, v in s[-3:]])) if s else None
                      for t, s in series.items()},
  }
  if num_steps:
    out["crossovers_per_100"] = per_100_steps(count_crossovers(records, tasks), num_steps)
    # Spikes need the running sigma of the pacing state: the trainer's own count is the source.
    out["spikes_per_100"] = per_100_steps(sum(r.get("num_entropy_spikes") or 0 for r in rl),
                                          num_steps)
  return out


def paired_differences(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
  """{seed: a[seed] - b[seed]} over the seeds both have a number for."""
  return {s: float(a[s]) - float(b[s]) for s in sorted(set(a) & set(b))
          if a[s] is not None and b[s] is not None}


def bootstrap_means(values: Sequence[float], num_resamples: int = 10_000,
                    seed: int = 0) -> np.ndarray:
  """Means of `num_resamples` resamples (with replacement, same size) of `values`: [R]."""
  values = np.asarray(values, float)
  if values.ndim != 1 or len(values) == 0:
    raise ValueError(f"need a non-empty 1-D sample, got shape {values.shape}")
  rng = np.random.default_rng(seed)
  index_RxN = rng.integers(0, len(values), size=(num_resamples, len(values)))
  return values[index_RxN].mean(axis=1)


def bootstrap_ci(values: Sequence[float], confidence: float = 0.95, num_resamples: int = 10_000,
                 seed: int = 0) -> tuple[float, float]:
  """Percentile bootstrap confidence interval of the mean of `values`."""
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
  means = bootstrap_means(values, num_resamples, seed)
  tail = 100.0 * (1.0 - confidence) / 2.0
  low, high = np.percentile(means, [tail, 100.0 - tail])
  return float(low), float(high)


def verdict(ci: Optional[tuple[float, float]], null_half_width: float = 0.05,
            n: Optional[int] = None) -> str:
  """The study's decision rule on a difference's confidence interval.

  "effect" when the interval excludes 0 (either sign); "clear null" when it holds 0 and its
  half-width is below `null_half_width`; otherwise "unresolved" (more seeds or episodes needed).
  With `n` paired seeds below `MIN_SEEDS` (the protocol's count), "pending": a bootstrap over one
  seed is a point and over a few is far too narrow, so no decision is read from it.
  """
  if n is not None and n < MIN_SEEDS:
    return f"pending (n < {MIN_SEEDS})"
  if ci is None:
    return "unresolved"
  low, high = ci
  if low > 0.0 or high < 0.0:
    return "effect"
  if (high - low) / 2.0 < null_half_width:
    return "clear null"
  return "unresolved"
