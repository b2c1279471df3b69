r"""EPPO vs baselines on the built-in multi-task suite: one SFT warm start, same compute, N seeds.

For each seed the SFT warm start runs once (`train.num_steps=0`); every method then resumes from a
copy of that step-0 checkpoint, so methods differ only in the RL objective. Writes, under --root:
`summary.json`, `results.md` (tables) and `curves.png` (per-task eval success and entropy).

  python bench/compare_methods.py --root runs/compare --seeds 0 1 2 \
      --methods eppo grpo dapo clip_cov --rl-steps 40
  # a pacing sweep: one "method" per setting
  python bench/compare_methods.py --root runs/sweep --seeds 0 1 2 --methods eppo \
      --variant alpha=0.5 --variant alpha=2 --variant rho=0.8 --variant rho=0.95
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import multitask  # pylint: disable=g-import-not-at-top,wrong-import-position


def _config(preset: str, seed: int, root: Path, rl_steps: int, overrides: dict):
  config = multitask.get_config(preset)
  config.seed = seed
  config.model.tiny_dir = str(root / f"tiny_model_seed{seed}")
  config.train.num_steps = rl_steps
  config.train.export_hf = False
  config.train.tensorboard = False
  for key, value in overrides.items():
    config.pacing.overrides[key] = value
  return config


def _parse_variant(text: str) -> dict:
  """"alpha=0.5,rho=0.8" -> {"alpha": 0.5, "rho": 0.8} (pacing / loss config fields)."""
  out = {}
  for item in filter(None, text.split(",")):
    key, value = item.split("=")
    out[key] = float(value)
  return out


def _read(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


CUT_KEYS = ("clip_frac_low", "clip_frac_high", "cov_selected_frac")


def summarize(records: list[dict], tasks: list[str]) -> dict:
  """Eval success (start, final, best, worst task), entropies, crossovers, spikes of one run."""
  evals = [r for r in records if r.get("eval_success") is not None and r["step"] >= 0]
  rl = [r for r in records if r["step"] > 0]
  per_task_final = [evals[-1].get(f"task/{t}/eval_success") for t in tasks]
  return {
      "start_success": evals[0]["eval_success"],
      "final_success": evals[-1]["eval_success"],
      "best_success": max(r["eval_success"] for r in evals),
      "worst_task_final": min(per_task_final),
      "per_task_final": dict(zip(tasks, per_task_final)),
      # Token entropy of the sampling policy per task: first RL step, and mean of the last 3.
      "entropy_start": {t: rl[0].get(f"task/{t}/entropy") for t in tasks} if rl else None,
      "entropy_end": {t: float(np.mean([r[f"task/{t}/entropy"] for r in rl[-3:]
                                        if r.get(f"task/{t}/entropy") is not None]))
                      for t in tasks} if rl else None,
      "crossovers": int(sum(r.get("entropy_crossovers") or 0 for r in rl)),
      "spikes": int(sum(r.get("num_entropy_spikes") or 0 for r in rl)),
      "train_success_last5": float(np.mean([r["success"] for r in rl[-5:]])) if rl else None,
      # Tokens whose gradient the objective cuts: ratio-clipped, or selected by Clip-Cov.
      "cut_frac": (float(np.mean([sum(r.get(k) or 0 for k in CUT_KEYS) for r in rl]))
                   if rl else None),
  }


def _mean_std(values) -> str:
  values = np.asarray([v for v in values if v is not None], float)
  return f"{values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.3f}"


def write_report(root: Path, runs: dict, tasks: list[str]) -> None:
  """results.md with a mean ± std table over seeds and curves.png."""
  lines = [f"Command: `python bench/compare_methods.py {' '.join(sys.argv[1:])}`", "",
           "| method | seeds | start (SFT) | final success | best success | worst task (final) "
           "| train success (last 5 steps) | crossovers | spikes |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, per_seed in runs.items():
    s = [v["summary"] for v in per_seed.values()]
    lines.append(f"| {name} | {len(s)} | {_mean_std(x['start_success'] for x in s)} | "
                 f"{_mean_std(x['final_success'] for x in s)} | "
                 f"{_mean_std(x['best_success'] for x in s)} | "
                 f"{_mean_std(x['worst_task_final'] for x in s)} | "
                 f"{_mean_std(x['train_success_last5'] for x in s)} | "
                 f"{_mean_std(x['crossovers'] for x in s)} | {_mean_std(x['spikes'] for x in s)} |")
  lines += ["", "Final eval success per task (mean ± std over seeds):", "",
            "| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
  for name, per_seed in runs.items():
    cells = [_mean_std(v["summary"]["per_task_final"][t] for v in per_seed.values())
             for t in tasks]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += ["", "Token entropy per task at the end (mean of the last 3 RL steps; mean ± std over "
            "seeds):", "", "| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
  first = next(iter(runs.values()))  # Step 1 samples from the shared SFT policy.
  cells = [_mean_std(v["summary"]["entropy_start"][t] for v in first.values()) for t in tasks]
  lines.append("| (SFT policy, RL step 1) | " + " | ".join(cells) + " |")
  for name, per_seed in runs.items():
    cells = [_mean_std(v["summary"]["entropy_end"][t] for v in per_seed.values()) for t in tasks]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  seeds = sorted({seed for per_seed in runs.values() for seed in per_seed})
  lines += ["", "Per seed: final eval success (tokens clipped or Clip-Cov-selected, mean over the "
            "RL steps):", "",
            "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
            "|---|" + "---|" * len(seeds)]
  for name, per_seed in runs.items():
    cells = [f"{per_seed[s]['summary']['final_success']:.3f} "
             f"({per_seed[s]['summary']['cut_frac']:.1%})" if s in per_seed else "-"
             for s in seeds]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  (root / "results.md").write_text("\n".join(lines) + "\n")

  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(2, len(tasks), figsize=(4.5 * len(tasks), 6.5), squeeze=False)
  for name, per_seed in runs.items():
    for col, task in enumerate(tasks):
      for row, metric in enumerate(("eval_success", "entropy")):
        curves = []
        for v in per_seed.values():
          pts = [(r["step"], r.get(f"task/{task}/{metric}")) for r in v["records"]
                 if r["step"] >= 0 and r.get(f"task/{task}/{metric}") is not None]
          curves.append(dict(pts))
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if steps:
          values = np.array([[c[s] for c in curves] for s in steps])  # [steps, seeds]
          mean, std = values.mean(1), values.std(1)
          line, = axes[row, col].plot(steps, mean, label=name)
          # The band is the spread over seeds (± 1 std), so a gap inside it is not a result.
          axes[row, col].fill_between(steps, np.maximum(mean - std, 0.0), mean + std, alpha=0.15,
                                      color=line.get_color())  # Both metrics are >= 0.
        axes[row, col].set_title(f"{task} {metric}")
        axes[row, col].set_xlabel("RL step")
  axes[0, 0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(root / "curves.png", dpi=90)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", default="runs/compare")
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--methods", nargs="+", default=["eppo", "grpo", "dapo", "clip_cov"])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--rl-steps", type=int, default=40)
  parser.add_argument("--variant", action="append", default=[],
                      help="pacing/loss overrides for an extra EPPO-family run, e.g. alpha=0.5")
  args = parser.parse_args()

  from eppo_jax import train  # pylint: disable=g-import-not-at-top
  root = Path(args.root)
  root.mkdir(parents=True, exist_ok=True)
  jobs = [(m, m, {}) for m in args.methods]
  jobs += [(f"{args.methods[0]}[{v}]", args.methods[0], _parse_variant(v)) for v in args.variant]
  runs: dict = {name: {} for name, _, _ in jobs}
  tasks = None
  for seed in args.seeds:
    warm = root / f"seed{seed}" / "sft"
    if not (warm / "final_metrics.json").exists():
      start = time.time()
      train.train(_config(args.preset, seed, root, 0, {}), warm)
      print(f"seed {seed}: SFT warm start {time.time() - start:.0f}s", flush=True)
    for name, method, overrides in jobs:
      workdir = root / f"seed{seed}" / name.replace("[", "_").replace("]", "").replace("=", "")
      config = _config(args.preset, seed, root, args.rl_steps, overrides)
      config.method = method
      tasks = list(config.tasks.specs)
      if not (workdir / "final_metrics.json").exists():
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(warm / "checkpoints", workdir / "checkpoints")
        start = time.time()
        train.train(config, workdir)
        print(f"seed {seed} {name}: {args.rl_steps} RL steps {time.time() - start:.0f}s",
              flush=True)
      records = _read(workdir)
      runs[name][seed] = {"records": records, "summary": summarize(records, tasks)}
      print(name, seed, json.dumps(runs[name][seed]["summary"]), flush=True)
      # Rewritten after every run, so an interrupted study still reports what it finished.
      done = {n: r for n, r in runs.items() if r}
      (root / "summary.json").write_text(json.dumps(
          {n: {s: v["summary"] for s, v in r.items()} for n, r in done.items()}, indent=1))
      write_report(root, done, tasks)
  print((root / "results.md").read_text())


if __name__ == "__main__":
  main()
