r"""The evidence study: methods compared from one SFT warm start per seed, resumable, one report.

For each seed the warm start runs once (`train.num_steps=0`: the SFT stage for the tiny model,
the LoRA initialisation for an HF preset); every method then continues from a copy of that step-0
checkpoint and its evaluation (played once), so methods differ only in the RL objective. Layout
under --root:

  protocol.json                the configuration every run of this root shares (checked on reuse)
  seed<S>/sft/                 the warm start of seed S
  seed<S>/<method>/            one RL run (metrics.jsonl, checkpoints/, final_metrics.json)
  results.md  summary.json  curves.png   the report of every finished run (rewritten after each)

A finished run (its final step logged) is skipped, a partial one resumes from its checkpoint, and a
run another process holds is left to it: seeds (or method x seed pairs) can run as separate
processes on one root and each writes the report of whatever is complete.

  python bench/study.py --root runs/study_easy                 # the protocol of docs/results.md
  python bench/study.py --root runs/study_easy --seeds 3 --methods eppo   # one run per process
  python bench/study.py --root runs/study_easy --report-only
  python bench/study.py --root runs/study_easy --report-only --seeds 0 1 2 3 4   # those seeds only
  python bench/study.py --root runs/study_easy --report-only --archive docs/data/study_easy
  python bench/study.py --root docs/data/study_easy --report-only   # the report from the archive
  python bench/study.py --root /tmp/s --preset smoke --seeds 0 1 --methods eppo grpo \
      --config.train.num_steps=2
  # An HF preset, unchanged but for the passthrough fields (one accelerator host):
  python bench/study.py --root runs/study_qwen --preset qwen2.5-0.5b \
      --config.model.source=/path/to/Qwen2.5-0.5B-Instruct --config.train.eval_instances_per_task=128
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import ml_collections

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from configs import multitask  # pylint: disable=g-import-not-at-top,wrong-import-position
from eppo_jax import workdir as workdir_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
import study_report  # pylint: disable=g-import-not-at-top,wrong-import-position

METHODS = ("eppo", "grpo", "dapo", "clip_cov")
SEEDS = (0, 1, 2, 3, 4)

# The study protocol (docs/results.md, "Evidence study"): the tiny preset with these fields changed.
# Fixed before any RL comparison ran; change it only together with that section. The tiny preset
# itself has changed since (turn cap, grids, update, warm start: "A default that learns"), so a
# new root runs the comparison on today's default; the archived runs' own configuration is their
# protocol.json (docs/data/study_easy), which `--report-only` reads them with.
# Neither declared mix passed the headroom check (runs/study, runs/study_fallback); by the rule
# of that section the study runs the closer one, the first (8 turns, 768 tokens), without
# sokoban:medium, which the tiny model cannot learn (1 success in 1,280 episodes after SFT).
STUDY_OVERRIDES = {
    "tasks.specs": ("sokoban:easy", "frozenlake:easy"),
    "train.num_steps": 100,
    "train.eval_every": 20,
    "train.eval_instances_per_task": 128,
    "train.checkpoint_every": 10,
}
# Fields that identify one run, not the protocol: left out of the protocol check.
_PER_RUN = ("seed", "method", "model.tiny_dir", "pacing.overrides")


def parse_value(text: str, current):
  """A command-line string as the type of the config field it replaces."""
  if isinstance(current, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    raise ValueError(f"cannot read {text!r} as a {type(current).__name__}") from None
  if isinstance(current, tuple) and isinstance(value, (list, tuple)):
    return tuple(value)
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if current is not None and not isinstance(value, type(current)):
    raise ValueError(f"{text!r} is a {type(value).__name__}, the field a {type(current).__name__}")
  return value


def set_field(config, dotted: str, value) -> None:
  """config.a.b = value for "a.b", with a one-line error for an unknown field."""
  *path, name = dotted.split(".")
  node = config
  for part in path:
    if part not in node:
      raise ValueError(f"unknown config field {dotted!r}")
    node = node[part]
  if name not in node:
    raise ValueError(f"unknown config field {dotted!r}")
  node[name] = value


def parse_overrides(extra: list[str]) -> list[tuple[str, str]]:
  """["--config.a.b=1", ...] -> [("a.b", "1"), ...]; anything else is a usage error."""
  out = []
  for arg in extra:
    if not arg.startswith("--config.") or "=" not in arg:
      raise ValueError(f"unexpected argument {arg!r} (config fields: --config.section.field=VALUE)")
    dotted, _, text = arg[len("--config."):].partition("=")
    out.append((dotted, text))
  return out


def apply_overrides(config, overrides) -> None:
  """Sets each ("a.b", text) of the command line, the text read as the field's type."""
  for dotted, text in overrides:
    current = config
    for part in dotted.split("."):
      if part not in current:
        raise ValueError(f"unknown config field {dotted!r}")
      current = current[part]
    set_field(config, dotted, parse_value(text, current))


def base_config(preset: str, overrides: list[tuple[str, str]]):
  """The preset ("study" = tiny + STUDY_OVERRIDES), then the command line's fields."""
  config = multitask.get_config("tiny" if preset == "study" else preset)
  if preset == "study":
    for dotted, value in STUDY_OVERRIDES.items():
      set_field(config, dotted, value)
  apply_overrides(config, overrides)
  config.train.export_hf = False
  config.train.tensorboard = False
  return config


def run_config(base, root: Path, seed: int, method: str, variant: dict, rl_steps: int):
  """One run's config: `base` with its seed, method, pacing variant and number of RL steps."""
  config = base.copy_and_resolve_references()
  config.seed = seed
  config.method = method
  config.train.num_steps = rl_steps
  if config.model.source == "tiny":  # One tiny model per seed, shared by its runs.
    config.model.tiny_dir = str(root / f"tiny_model_seed{seed}")
  for key, value in variant.items():
    config.pacing.overrides[key] = value
  return config


def protocol(config) -> dict:
  """The fields every run of a root shares."""
  out = json.loads(config.to_json())
  for dotted in _PER_RUN:
    *path, name = dotted.split(".")
    node = out
    for part in path:
      node = node[part]
    node.pop(name, None)
  return out


def check_protocol(root: Path, config) -> None:
  """Writes root/protocol.json, or refuses a root whose runs used another configuration."""
  path = root / "protocol.json"
  mine = protocol(config)
  if path.exists():
    theirs = json.loads(path.read_text())
    # A root accepts what changes only the layout of the same computation (mesh, attention
    # blocks): rounding, not protocol.
    diff = sorted(k for k in workdir_lib.recorded_changes(theirs, mine)
                  if not workdir_lib.is_safe(k, workdir_lib.LAYOUT_FIELDS))
    if diff:
      raise SystemExit(f"{root} holds runs of another configuration (differs in {', '.join(diff)})"
                       "; use another --root")
  else:
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mine, indent=1, sort_keys=True))


def parse_variant(text: str) -> dict:
  """"alpha=0.5,entropy_tokens=action" -> {"alpha": 0.5, "entropy_tokens": "action"} (pacing
  config fields: numbers as floats, anything else as a string)."""
  out = {}
  for item in filter(None, text.split(",")):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"a variant is key=value[,key=value], got {text!r}")
    try:
      out[key.strip()] = float(value)
    except ValueError:
      out[key.strip()] = value.strip()
  return out


def run_name(method: str, variant_text: str = "") -> str:
  """The run's directory name: "eppo", or "eppo_alpha0.5" for the variant "alpha=0.5"."""
  if not variant_text:
    return method
  return f"{method}_" + variant_text.replace("=", "").replace(",", "_")


@contextlib.contextmanager
def locked(path: Path, wait: bool):
  """An exclusive lock on `path` (yields False when `wait` is off and another process holds it)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
      yield False
      return
    try:
      yield True
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def warm_start(base, root: Path, seed: int) -> Path:
  """The seed's step-0 checkpoint (SFT or LoRA init), trained once whichever process asks first."""
  from eppo_jax import train  # pylint: disable=g-import-not-at-top
  warm = root / f"seed{seed}" / "sft"
  with locked(root / f"seed{seed}" / "sft.lock", wait=True):
    if not study_report.finished(warm, 0):
      start = time.time()
      train.train(run_config(base, root, seed, base.method, {}, 0), warm)
      print(f"seed {seed}: warm start {time.time() - start:.0f}s", flush=True)
  return warm


def run_one(base, root: Path, seed: int, method: str, variant_text: str) -> str:
  """Trains (or resumes, or skips) one method x seed run; -> "done", "trained" or "busy"."""
  from eppo_jax import train  # pylint: disable=g-import-not-at-top
  config = run_config(base, root, seed, method, parse_variant(variant_text), base.train.num_steps)
  workdir = root / f"seed{seed}" / run_name(method, variant_text)
  if study_report.finished(workdir, config.train.num_steps):
    return "done"
  warm = warm_start(base, root, seed)
  with locked(root / f"seed{seed}" / f"{workdir.name}.lock", wait=False) as mine:
    if not mine:
      return "busy"
    if not (workdir / "checkpoints").exists():
      # Copied whole under a temporary name, so an interrupted copy is never taken for a start.
      partial = workdir.parent / f".{workdir.name}.copy"
      shutil.rmtree(partial, ignore_errors=True)
      shutil.copytree(warm / "checkpoints", partial / "checkpoints")
      os.replace(partial, workdir)
    start = time.time()
    train.train(config, workdir)
    print(f"seed {seed} {workdir.name}: trained to RL step {config.train.num_steps} in "
          f"{time.time() - start:.0f}s", flush=True)
  return "trained"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", default="runs/study_easy")
  parser.add_argument("--preset", default="study",
                      help="study (the protocol), or a configs/multitask.py preset run unchanged")
  parser.add_argument("--methods", nargs="+", default=list(METHODS))
  parser.add_argument("--seeds", nargs="+", type=int,
                      help=f"default {' '.join(map(str, SEEDS))}; with --report-only, the seeds "
                           "to report (default: every finished one)")
  parser.add_argument("--variant", action="append", default=[],
                      help="a pacing variant of the first method, e.g. alpha=0.5 (repeatable)")
  parser.add_argument("--baseline", default="grpo", help="the method differences are taken to")
  parser.add_argument("--report-only", action="store_true", help="train nothing, write the report")
  parser.add_argument("--warm-only", action="store_true",
                      help="train the seeds' warm starts only (the task-mix headroom check)")
  parser.add_argument("--archive", metavar="DIR",
                      help="then copy the finished runs' records (no checkpoints) to DIR, a root "
                           "that --report-only reads: commit it to keep the study's data")
  args, extra = parser.parse_known_args(argv)
  try:
    base = base_config(args.preset, parse_overrides(extra))
  except ValueError as e:
    parser.error(str(e))
  root = Path(args.root)
  if args.archive and Path(args.archive).resolve() == root.resolve():
    parser.error("--archive needs a directory other than --root (it trims the records it copies)")
  if args.report_only and (root / "protocol.json").exists():
    # Reported as its runs were configured, whatever the preset holds today.
    base = ml_collections.ConfigDict(json.loads((root / "protocol.json").read_text()))
  else:
    check_protocol(root, base)
  jobs = [(m, "") for m in args.methods] + [(args.methods[0], v) for v in args.variant]
  given = " ".join(argv if argv is not None else sys.argv[1:])
  prefix = " ".join(["python bench/study.py --root", shlex.quote(str(root)), "--preset",
                     args.preset] + [shlex.quote(e) for e in extra])
  command = (prefix, f"python bench/study.py {given}")
  if not args.report_only:
    for seed in args.seeds or SEEDS:
      if args.warm_only:
        warm_start(base, root, seed)
        study_report.write_report(root, base, args.baseline, command)
        continue
      for method, variant in jobs:
        status = run_one(base, root, seed, method, variant)
        if status != "trained":
          print(f"seed {seed} {run_name(method, variant)}: "
                f"{'finished earlier' if status == 'done' else 'running in another process'}",
                flush=True)
        # Rewritten after every run, so an interrupted study still reports what it finished.
        study_report.write_report(root, base, args.baseline, command)
  study_report.write_report(root, base, args.baseline, command,
                            seeds=args.seeds if args.report_only else None)
  print((root / "results.md").read_text())
  if args.archive:
    count = study_report.archive(root, Path(args.archive), base.train.num_steps)
    print(f"archived the records of {count} finished runs and warm starts to {args.archive}")


if __name__ == "__main__":
  main()
