r"""The pace-mismatch screen's rule (docs/results.md, "Stage A"), applied to finished study roots.

Each root is one screened configuration, run by `bench/study.py --methods grpo`. Per configuration,
as means over its seeds: the worst-task eval gain from step 0 to the last step, the fraction of
trained tokens clipped per RL step, and the easier task's early entropy as a fraction of the
harder task's; crossovers and spikes per 100 steps next to them. Prints a markdown table; `--plot`
also draws every configuration's per-task eval success and entropy.

  python bench/screen.py runs/screen_weak runs/screen_weak_hot runs/screen_hot
  python bench/screen.py docs/data/screen_* --plot docs/images/screen.png   # from the archive
  python bench/screen.py runs/default --method eppo   # another method's runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import study_report  # pylint: disable=g-import-not-at-top,wrong-import-position
import study_stats as stats  # pylint: disable=g-import-not-at-top,wrong-import-position

# The declared rule: thresholds, and the early window of the entropy comparison (RL steps).
MIN_GAIN, MIN_CLIPPED, MAX_ENTROPY_RATIO, EARLY = 0.15, 0.05, 0.5, (1, 10)


def worst_task_gain(records: list[dict], tasks) -> float:
  """min over tasks of eval success at the last eval step minus the same at step 0."""
  curves = [stats.eval_curve(records, f"task/{t}/eval_success")[1] for t in tasks]
  return float(min(c[-1] for c in curves) - min(c[0] for c in curves))


def clipped_fraction(records: list[dict]) -> float:
  """Mean over RL steps of the batch's clipped share of trained tokens (both sides)."""
  rl = [r for r in records if r["step"] > 0 and "clip_frac_low" in r]
  return float(np.mean([r["clip_frac_low"] + r["clip_frac_high"] for r in rl]))


def early_entropy(records: list[dict], task: str) -> float:
  """The task's mean batch entropy over the RL steps of `EARLY`."""
  lo, hi = EARLY
  return float(np.mean([h for s, h in stats.entropy_series(records, task) if lo <= s <= hi]))


def finished_runs(root: Path, method: str = "grpo") -> tuple[list[str], dict[int, list[dict]]]:
  """(the root's tasks, {seed: records} of each of its finished `method` runs)."""
  protocol = json.loads((root / "protocol.json").read_text())
  done, _ = study_report.load_runs(root, protocol["train"]["num_steps"])
  runs = dict(sorted(done.get(method, {}).items()))
  if not runs:
    raise SystemExit(f"{root}: no finished {method} run")
  return list(protocol["tasks"]["specs"]), runs


def screen(root: Path, method: str = "grpo") -> dict:
  """The rule's numbers for one root (its finished runs of `method`)."""
  tasks, by_seed = finished_runs(root, method)
  runs = list(by_seed.values())
  start = {t: np.mean([stats.eval_curve(r, f"task/{t}/eval_success")[1][0] for r in runs])
           for t in tasks}
  easy, hard = sorted(tasks, key=lambda t: -start[t])[:2]
  per_run = [stats.run_metrics(r, tasks) for r in runs]
  out = dict(
      root=str(root), seeds=len(runs), easy=easy, hard=hard,
      gains={seed: worst_task_gain(r, tasks) for seed, r in by_seed.items()},
      clipped=float(np.mean([clipped_fraction(r) for r in runs])),
      entropy_easy=float(np.mean([early_entropy(r, easy) for r in runs])),
      entropy_hard=float(np.mean([early_entropy(r, hard) for r in runs])),
      crossovers_per_100=float(np.mean([m["crossovers_per_100"] for m in per_run])),
      spikes_per_100=float(np.mean([m["spikes_per_100"] for m in per_run])))
  out["gain"] = float(np.mean(list(out["gains"].values())))
  out["entropy_ratio"] = out["entropy_easy"] / out["entropy_hard"]
  out["passes"] = dict(learns=out["gain"] >= MIN_GAIN, binds=out["clipped"] >= MIN_CLIPPED,
                       mismatch=out["entropy_ratio"] <= MAX_ENTROPY_RATIO)
  return out


def table(rows: list[dict]) -> str:
  yes = lambda ok: "yes" if ok else "no"
  lines = ["| configuration | seeds | worst-task gain | clipped tokens / step | "
           f"easier task | its entropy / the harder's, steps {EARLY[0]}-{EARLY[1]} | "
           "crossovers / 100 | spikes / 100 | in the regime |", "|---" * 9 + "|"]
  for r in rows:
    p = r["passes"]
    lines.append(
        f"| {Path(r['root']).name} | {r['seeds']} | {r['gain']:+.3f} ({yes(p['learns'])}) | "
        f"{100 * r['clipped']:.2f}% ({yes(p['binds'])}) | {r['easy']} | {r['entropy_easy']:.3f} / "
        f"{r['entropy_hard']:.3f} = {r['entropy_ratio']:.2f} ({yes(p['mismatch'])}) | "
        f"{r['crossovers_per_100']:.1f} | {r['spikes_per_100']:.1f} | {yes(all(p.values()))} |")
  return "\n".join(lines)


def plot(path: Path, roots: list[Path], method: str = "grpo") -> None:
  """One row per configuration: each task's eval success and token entropy, mean ± std."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(12, 3.2 * len(roots)))
  axes = fig.subplots(len(roots), 2, squeeze=False)
  for row, root in zip(axes, roots):
    tasks, by_seed = finished_runs(root, method)
    runs = list(by_seed.values())
    for task in tasks:
      study_report._band(row[0], [dict(zip(*stats.eval_curve(r, f"task/{task}/eval_success")))
                                  for r in runs], task)  # pylint: disable=protected-access
      study_report._band(row[1], [dict(stats.entropy_series(r, task)) for r in runs],
                         task)  # pylint: disable=protected-access
    row[0].set_title(f"{root.name}: eval success")
    row[1].set_title(f"{root.name}: token entropy (nats)")
    row[0].set_ylim(-0.02, 1.02)
    for ax in row:
      ax.set_xlabel("RL step")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("roots", nargs="+", type=Path, help="one study root per configuration")
  parser.add_argument("--plot", type=Path, help="also write the curves of every configuration")
  parser.add_argument("--method", default="grpo", help="whose runs to read (default: grpo)")
  args = parser.parse_args(argv)
  rows = [screen(root, args.method) for root in args.roots]
  print(table(rows))
  for r in rows:
    gains = ", ".join(f"seed {seed} {g:+.3f}" for seed, g in r["gains"].items())
    print(f"{Path(r['root']).name}: worst-task gain per seed: {gains}")
  if args.plot:
    plot(args.plot, args.roots, args.method)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
