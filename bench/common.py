"""Helpers shared by the benchmarks: core pinning, worker processes, the peer's thread settings.

Every benchmark that times PyTorch (HF `generate`, TRL, a PyTorch update) runs each side in its
own fresh process, pinned to the same cores, and times the peer at two thread settings: 1 thread
and PyTorch's default. On a shared machine PyTorch with several OpenMP threads can become 10-30x
slower than with 1 (each parallel op waits at a barrier for a thread that another process's load
has descheduled), so a ratio against the default alone mostly measures the load; the faster
setting is the peer's fair figure. The processes are interleaved (ours, peer@1, peer@default, then
rotated) and repeated, and medians are reported, so slow drift of the machine's load hits every
side alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

RESULT = "RESULT "  # Prefix of the one stdout line that carries a worker's JSON result.

# name -> ModelConfig kwargs. tiny: the default config's sizes (configs/multitask.py); 100m: a
# ~125M-parameter Llama (GPT-2-small width, Llama vocabulary, grouped-query attention).
MODELS = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                 num_heads=12, num_kv_heads=4, head_dim=64, tie_word_embeddings=False),
}


def tiny_model_options(model) -> dict:
  """The fields of ModelConfig `model` that the trainer sets from the tiny preset (its attention
  blocks, which are chosen for CPU): the benchmarks run the model as the default job runs it."""
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  from configs import multitask  # pylint: disable=g-import-not-at-top
  from eppo_jax import programs  # pylint: disable=g-import-not-at-top
  model = programs.model_config(multitask.get_config("tiny"), model)
  return {k: getattr(model, k) for k in ("remat", "attention_impl", "attention_block_q",
                                         "attention_block_k")}


def use_cores(n: int) -> int:
  """Pins this process (and its children) to its first `n` allowed cores (0 = all); -> core count.

  Call it before jax is imported: XLA sizes its CPU thread pool from the affinity mask when it
  starts, and worker processes inherit the mask, so both sides then run on the same cores.
  """
  if "jax" in sys.modules and n:
    raise RuntimeError("use_cores() must run before jax is imported (XLA sizes its thread pool "
                       "from the affinity mask at start-up)")
  allowed = sorted(os.sched_getaffinity(0))
  if n:
    if n > len(allowed):
      raise SystemExit(f"--cores {n}: only {len(allowed)} cores are available")
    os.sched_setaffinity(0, allowed[:n])
  return len(os.sched_getaffinity(0))


def torch_default_threads() -> int:
  """PyTorch's default intra-op thread count in a fresh process on this process's cores."""
  out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                       capture_output=True, text=True, check=True)
  return int(out.stdout.split()[-1])


def peer_thread_settings(default_threads: int) -> list[int]:
  """Thread counts to time the PyTorch side at: [1, default], or [1] where the default is 1.

  0 stands for "PyTorch's default" (the worker leaves `torch.set_num_threads` alone).
  """
  return [1] if default_threads == 1 else [1, 0]


def set_torch_threads(threads: int) -> int:
  """Applies a thread setting from `peer_thread_settings` (0 = default); -> threads in use."""
  import torch  # pylint: disable=g-import-not-at-top
  if threads:
    torch.set_num_threads(threads)
  return torch.get_num_threads()


def setting_name(threads: int, default: Optional[int] = None) -> str:
  """'1 thread' / 'default (2 threads)' for the tables."""
  if threads == 1:
    return "1 thread"
  return f"default ({default} threads)" if default else "default threads"


def emit(result: dict) -> None:
  """Prints a worker's result as the one line the driver parses."""
  print(RESULT + json.dumps(result), flush=True)


def run_worker(script: str, argv: Sequence[str]) -> dict:
  """Runs `python script argv...` in a fresh process (same cores) and returns its emitted dict."""
  cmd = [sys.executable, os.path.abspath(script), *argv]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    raise RuntimeError(f"worker failed (exit {proc.returncode}): {' '.join(cmd)}")
  return json.loads(lines[-1][len(RESULT):])


def interleaved(jobs: dict, repeats: int,
                log: Optional[Callable[[str], None]] = None) -> dict[str, list[dict]]:
  """Runs every job `repeats` times, rotating their order each round; -> name -> results.

  `jobs` maps a name ("ours", or a peer thread setting) to a function that runs one fresh process.

  Rotation puts each side first, middle and last in turn, so a change of the machine's load
  during the benchmark lands on every side rather than on whichever ran last.
  """
  names = list(jobs)
  results = {name: [] for name in names}
  for r in range(repeats):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      results[name].append(jobs[name]())
      label = name if isinstance(name, str) else f"peer at {setting_name(name)}"
      (log or _stderr)(f"  round {r + 1}/{repeats}: {label} done")
  return results


def _stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def median(results: list[dict], key: str) -> float:
  """Median of `key` over the repeated runs of one side."""
  return float(np.median([r[key] for r in results]))


def spread(results: list[dict], key: str) -> str:
  """'min-max' of `key` over the repeats, to print next to the median."""
  values = [r[key] for r in results]
  return f"{min(values):.3g}-{max(values):.3g}"


def fastest(seconds_by_setting: dict[int, float]) -> int:
  """The peer setting with the smallest median time."""
  return min(seconds_by_setting, key=seconds_by_setting.get)


def _tuples(x):
  """JSON's lists back as the tuples a config holds."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _recorded_over(defaults: dict, recorded: dict) -> dict:
  """`recorded`'s fields, and `defaults`' for the fields it lacks (at any depth)."""
  out = dict(defaults)
  for key, value in recorded.items():
    both = isinstance(value, dict) and isinstance(defaults.get(key), dict)
    out[key] = _recorded_over(defaults[key], value) if both else value
  return out


def load_run_config(workdir: Path, overrides: Sequence[tuple[str, str]] = ()):
  """A finished run's config (its `config.json`) with `overrides` ("a.b", "text") applied, for a
  scratch copy of the run: no TensorBoard, plots or W&B."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  import study  # pylint: disable=g-import-not-at-top
  path = workdir / "config.json"
  if not path.exists():
    raise SystemExit(f"{path} does not exist: the workdir must hold a run (python run.py ... or "
                     "bench/study.py writes one)")
  from configs import multitask  # pylint: disable=g-import-not-at-top
  # Fields added to the config since the run was recorded take their defaults.
  defaults = json.loads(multitask.base_config().to_json())
  config = ml_collections.ConfigDict(_tuples(_recorded_over(defaults,
                                                            json.loads(path.read_text()))))
  try:
    study.apply_overrides(config, overrides)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  config.train.tensorboard = config.train.plots = False
  config.train.wandb_project = ""
  return config


def scratch_run(workdir: Path, config, scratch: Path) -> Path:
  """A copy of `workdir`'s checkpoints (and of its tiny model) under `scratch`, so that setting
  a trainer up there (which opens logs and a checkpoint manager) writes nothing in `workdir`."""
  import shutil  # pylint: disable=g-import-not-at-top
  if not (workdir / "checkpoints").is_dir():
    raise SystemExit(f"{workdir}/checkpoints does not exist: the workdir holds no policy")
  run = scratch / "run"
  shutil.copytree(workdir / "checkpoints", run / "checkpoints",
                  ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp*"))
  if config.model.source == "tiny":
    tiny = Path(config.model.tiny_dir or workdir / "tiny_model")
    if not (tiny / "eppo_jax_tiny.json").exists():
      raise SystemExit(f"the run's tiny model {tiny} is missing")
    shutil.copytree(tiny, scratch / "tiny_model")
    config.model.tiny_dir = str(scratch / "tiny_model")
  return run

