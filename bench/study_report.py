"""The evidence study's report: tables, paired differences with bootstrap CIs, and seed-band plots.

Reads every run under a study root (see bench/study.py), whatever process trained it, and writes
`results.md`, `summary.json` and `curves.png` there. Only finished runs enter the numbers; each
table says how many seeds it holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

import study_stats as stats

# (key in study_stats.run_metrics, label) of the numbers compared per seed; the first is the
# study's primary metric (the decision rule of docs/results.md applies to it).
METRICS = (("worst_task_final", "worst-task success (final)"),
           ("final_success", "mean success (final)"),
           ("auc_success", "mean success (AUC)"),
           ("worst_task_auc", "worst-task success (AUC)"),
           ("crossovers_per_100", "entropy crossovers / 100 steps"),
           ("spikes_per_100", "entropy spikes / 100 steps"),
           ("collapse_events", "collapse events (entropy < 0.05)"))
KNOWN_METHODS = ("eppo", "grpo", "dapo", "clip_cov", "kl_cov")
NUM_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
# The logged numbers an archived run keeps: what the report reads, and what docs/results.md quotes
# (the warm start's loss, bounds, clipping, KL, invalid actions). Timings and the rest of a record
# are dropped.
ARCHIVED_KEY = re.compile(
    r"(step|sft_loss|success|eval_success|entropy|entropy_crossovers|num_entropy_spikes|approx_kl|"
    r"grad_norm|advantage_abs_mean|clip_frac_low|clip_frac_high|truncated|zero_variance_groups|"
    r"task/[^/]+/(eval_success|success|entropy|action_entropy|entropy_spikes|eps_low|eps_high|"
    r"clip_frac_low|clip_frac_high|approx_kl|invalid_actions|eval_invalid_actions|turns|"
    r"zero_variance_groups))")


def read_records(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(workdir: Path, num_steps: int) -> bool:
  """True when the run has logged its final step (`final_metrics.json` at step >= num_steps)."""
  path = workdir / "final_metrics.json"
  return path.exists() and json.loads(path.read_text()).get("step", -1) >= num_steps


def _logged_workdirs(root: Path):
  """(seed, run directory) of every run under `root/seed<S>/` that has logged a record."""
  for log in sorted(root.glob("seed*/*/metrics.jsonl")):
    seed = log.parent.parent.name[len("seed"):]
    if seed.isdigit():
      yield int(seed), log.parent


def load_runs(root: Path, num_steps: int) -> tuple[dict, dict]:
  """({name: {seed: records}} of finished runs, {name: {seed: last step}} of unfinished ones)."""
  done, partial = {}, {}
  for seed, workdir in _logged_workdirs(root):
    if workdir.name == "sft":
      continue
    records = read_records(workdir)
    if finished(workdir, num_steps):
      done.setdefault(workdir.name, {})[seed] = records
    else:
      partial.setdefault(workdir.name, {})[seed] = max((r["step"] for r in records), default=0)
  return done, partial


def archive(root: Path, dest: Path, num_steps: int) -> int:
  """Copies the records of every finished run and warm start under `root` to `dest`; -> runs copied.

  `dest` keeps the root's layout (protocol.json, seed<S>/<run>/metrics.jsonl, final_metrics.json,
  config.json)
  with each record cut to `ARCHIVED_KEY`, so it is itself a root that `--report-only` reports
  exactly as the original: small enough to commit, where checkpoints and run directories are not.
  """
  copied = 0
  dest.mkdir(parents=True, exist_ok=True)
  shutil.copy2(root / "protocol.json", dest / "protocol.json")
  for _, workdir in _logged_workdirs(root):
    if not finished(workdir, 0 if workdir.name == "sft" else num_steps):
      continue
    kept = [{k: v for k, v in r.items() if ARCHIVED_KEY.fullmatch(k)} for r in read_records(workdir)]
    out = dest / workdir.relative_to(root)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept))
    shutil.copy2(workdir / "final_metrics.json", out / "final_metrics.json")
    if (workdir / "config.json").exists():  # What the run was (bench/pacing_replay.py reads it).
      shutil.copy2(workdir / "config.json", out / "config.json")
    copied += 1
  return copied


def _only_seeds(runs: dict, seeds) -> dict:
  """{name: {seed: x}} restricted to `seeds`, without names left empty."""
  kept = {name: {s: x for s, x in per_seed.items() if s in seeds} for name, per_seed in runs.items()}
  return {name: per_seed for name, per_seed in kept.items() if per_seed}


def _ordered(names, first: str) -> list[str]:
  return sorted(names, key=lambda n: (n != first, n))


def _step0(records: list[dict], key: str):
  return next((r[key] for r in records if r["step"] == 0 and r.get(key) is not None), None)


def _cell(value) -> str:
  return "-" if value is None else f"{value:.3f}"


def _mean_std(values) -> str:
  values = np.asarray([v for v in values if v is not None], float)
  if not len(values):
    return "-"
  return f"{values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.3f}"


def differences(metrics: dict, treatment: str, baseline: str, keys) -> dict:
  """{key: paired treatment - baseline per seed, its mean, 95% bootstrap CI and verdict}."""
  out = {}
  for key in keys:
    a = {s: m[key] for s, m in metrics[treatment].items() if key in m}
    b = {s: m[key] for s, m in metrics[baseline].items() if key in m}
    diff = stats.paired_differences(a, b)
    ci = (stats.bootstrap_ci(list(diff.values()), 0.95, NUM_RESAMPLES, BOOTSTRAP_SEED)
          if diff else None)
    out[key] = {"per_seed": diff, "n": len(diff),
                "mean": float(np.mean(list(diff.values()))) if diff else None,
                "ci95": ci, "verdict": stats.verdict(ci, n=len(diff))}
  return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(r) + " |" for r in rows])


def write_report(root: Path, config, baseline: str, command: tuple[str, str],
                 seeds: Optional[Sequence[int]] = None) -> dict:
  """results.md, summary.json and curves.png from the finished runs under `root`.

  `command` is (the driver's command without --seeds/--methods, the command that ran now);
  `seeds`, when given, keeps those seeds' runs only (a report as it stood at an earlier seed count).
  """
  tasks = list(config.tasks.specs)
  t = config.train
  done, partial = load_runs(root, t.num_steps)
  if seeds is not None:
    done, partial = _only_seeds(done, seeds), _only_seeds(partial, seeds)
  metrics = {name: {seed: stats.run_metrics(recs, tasks) for seed, recs in per_seed.items()}
             for name, per_seed in done.items()}
  names = _ordered(done, "eppo")
  seeds = sorted({s for per_seed in done.values() for s in per_seed})
  methods = [n for n in names if n in KNOWN_METHODS]
  variants = [n for n in names if n not in KNOWN_METHODS]
  if seeds:
    origin = (f"Every finished run below is reproduced by `{command[0]} --seeds "
              f"{' '.join(map(str, seeds))} --methods {' '.join(methods)}`"
              + (f" (and `--variant` for {', '.join(variants)})" if variants else "")
              + "; one process per seed with `--seeds S`.")
    if not any(root.glob("seed*/*/checkpoints")):
      origin += (" This root is an archive (records, no checkpoints; the runs' configuration is "
                 "its protocol.json, which the preset may no longer equal): give the training "
                 "command a new `--root`.")
  else:
    origin = f"No run has finished yet; the driver is `{command[0]}`."
  lines = ["# Study report", "",
           origin + " The same command with `--report-only` rewrites this report. Last written "
           f"by `{command[1]}`.", "",
           f"Tasks {', '.join(tasks)}; {t.num_steps} RL steps; eval on "
           f"{t.eval_instances_per_task} held-out instances per task (greedy) every "
           f"{t.eval_every or t.num_steps} steps and at step 0. Numbers are mean ± std over the "
           "finished seeds (n).", ""]
  for name in _ordered(set(done) | set(partial), "eppo"):
    found = sorted(done.get(name, {}))
    unfinished = ", ".join(f"seed {s} at step {step}" for s, step in
                           sorted(partial.get(name, {}).items()))
    lines.append(f"- {name}: finished seeds {found or 'none'}"
                 + (f"; unfinished: {unfinished}" if unfinished else ""))
  lines.append("")
  warm = {int(d.parent.name[4:]): read_records(d) for d in sorted(root.glob("seed*/sft"))
          if d.parent.name[4:].isdigit() and finished(d, 0)}
  if seeds is not None:
    warm = {seed: recs for seed, recs in warm.items() if seed in seeds}
  if warm:
    rows = [[f"seed {seed}"] + [_cell(_step0(recs, f"task/{task}/eval_success")) for task in tasks]
            + [_cell(_step0(recs, "eval_success"))] for seed, recs in sorted(warm.items())]
    rows.append(["mean ± std"] + [_mean_std(_step0(r, f"task/{task}/eval_success")
                                            for r in warm.values()) for task in tasks]
                + [_mean_std(_step0(r, "eval_success") for r in warm.values())])
    lines += ["## Warm starts (eval success after SFT, RL step 0)", ""]
    lines += _table(["seed"] + tasks + ["mean"], rows) + [""]
  if not names:
    lines.append("No finished run yet.")
    _write(root / "results.md", "\n".join(lines) + "\n")
    return {}

  header = ["method", "n", "start (SFT)"] + [label for _, label in METRICS]
  rows = [[n, str(len(metrics[n])), _mean_std(m["start_success"] for m in metrics[n].values())]
          + [_mean_std(m.get(k) for m in metrics[n].values()) for k, _ in METRICS] for n in names]
  lines += ["## Per method", ""] + _table(header, rows)
  for key, title in (("per_task_final", "Final eval success per task"),
                     ("per_task_auc", "Eval success per task, area under the curve / steps"),
                     ("per_task_collapse_events", "Collapse events per task (entropy < 0.05)"),
                     ("entropy_end", "Token entropy per task, mean of the last 3 RL steps")):
    rows = [[n] + [_mean_std(m[key][task] for m in metrics[n].values()) for task in tasks]
            for n in names]
    lines += ["", f"## {title}", ""] + _table(["method"] + tasks, rows)
  first_step = [[_mean_std(stats.entropy_series(recs, task)[0][1]
                           for recs in done[names[0]].values()
                           if stats.entropy_series(recs, task)) for task in tasks]]
  lines += ["", "Token entropy of the warm-start policy (RL step 1, sampled before any update; "
            f"{names[0]}'s seeds):", ""] + _table(tasks, first_step)

  diffs = {}
  if baseline in metrics:
    keys = [k for k, _ in METRICS] + [f"final:{task}" for task in tasks]
    for per_seed in metrics.values():
      for m in per_seed.values():
        m.update({f"final:{task}": m["per_task_final"][task] for task in tasks})
    for name in names:
      if name == baseline:
        continue
      diffs[name] = differences(metrics, name, baseline, keys)
      labels = dict(METRICS)
      rows = []
      for key in keys:
        d = diffs[name][key]
        ci = "-" if d["ci95"] is None else f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"
        per_seed = ", ".join(f"{s}: {v:+.3f}" for s, v in d["per_seed"].items())
        rows.append([labels.get(key, key.replace("final:", "success (final) ")), str(d["n"]),
                     "-" if d["mean"] is None else f"{d['mean']:+.3f}", ci, d["verdict"],
                     per_seed])
      lines += ["", f"## Paired difference {name} − {baseline}", "",
                f"Per seed, then the mean over seeds with a 95% percentile bootstrap interval "
                f"({NUM_RESAMPLES:,} resamples of the seeds, RNG seed {BOOTSTRAP_SEED}). Verdict: "
                "effect = the interval excludes 0; clear null = it holds 0 and is narrower than "
                f"± 0.05; else unresolved; pending while fewer than {stats.MIN_SEEDS} seeds are paired. "
                "The first row is the primary metric.", ""]
      lines += _table(["metric", "n", "mean", "95% CI", "verdict", "per seed"], rows)
  lines += ["", "![eval success and token entropy per task, mean over seeds, band = ± 1 std]"
            "(curves.png)"]
  _write(root / "results.md", "\n".join(lines) + "\n")
  summary = {"tasks": tasks, "num_steps": t.num_steps, "runs": metrics, "differences": diffs,
             "unfinished": partial}
  _write(root / "summary.json", json.dumps(summary, indent=1, default=str, sort_keys=True))
  plot(root / "curves.png", done, names, tasks)
  return summary


def _write(path: Path, text: str) -> None:
  """Replaces `path` whole: processes sharing a root never see a half-written report."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}")
  tmp.write_text(text)
  os.replace(tmp, path)


def _band(ax, curves: list[dict], label: str) -> None:
  """Mean over seeds of {step: value} curves, with a ± 1 std band, on the steps all seeds have."""
  steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
  if not steps:
    return
  values_SxN = np.array([[c[s] for c in curves] for s in steps])
  mean, std = values_SxN.mean(1), values_SxN.std(1)
  line, = ax.plot(steps, mean, label=label, marker="." if len(steps) < 15 else None)
  # The band is the spread over seeds, so a gap inside it is not a result. Both metrics are >= 0.
  ax.fill_between(steps, np.maximum(mean - std, 0.0), mean + std, alpha=0.15,
                  color=line.get_color())


def plot(path: Path, done: dict, names: list[str], tasks: list[str]) -> None:
  """Per task: eval success and token entropy against RL step, one line per method."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  cols = len(tasks) + 1
  fig = Figure(figsize=(4.2 * cols, 6.5))
  axes = fig.subplots(2, cols, squeeze=False)
  for name in names:
    runs = list(done[name].values())
    for col, task in enumerate(tasks):
      _band(axes[0, col], [dict(zip(*stats.eval_curve(r, f"task/{task}/eval_success")))
                           for r in runs], name)
      _band(axes[1, col], [dict(stats.entropy_series(r, task)) for r in runs], name)
    _band(axes[0, -1], [dict(zip(*stats.eval_curve(r))) for r in runs], name)
  for col, task in enumerate(tasks):
    axes[0, col].set_title(f"{task}: eval success")
    axes[1, col].set_title(f"{task}: token entropy (nats)")
    axes[1, col].axhline(stats.COLLAPSE_NATS, color="gray", lw=0.8, ls="--")
  axes[0, -1].set_title("mean eval success")
  for ax in axes[0]:
    ax.set_ylim(-0.02, 1.02)
  axes[1, -1].axis("off")
  for ax in axes.flat:
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  axes[0, -1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
