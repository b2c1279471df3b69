"""One run per workdir: the workdir records its config and software, and refuses another config.

`claim(config, workdir)` runs before anything is written. A fresh workdir gets `config.json` (the
full config) and `run_info.json` (package versions, Python, platform, devices, start time). A rerun
with the same config resumes; a rerun whose config differs only in fields of `SAFE_CHANGES` (how
long to train, how often to log or save, how environments are stepped, how the same model is laid
out and computed: mesh, remat, attention kernel) resumes with the new values; any other change is
refused with the changed fields listed, unless `config.train.allow_config_change` is True.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any

import jax
import ml_collections

CONFIG_FILE = "config.json"
RUN_INFO_FILE = "run_info.json"
# Fields that change how the same computation is laid out and run, not what it computes (results
# differ by rounding at most). A prefix ending in "." covers a whole section.
LAYOUT_FIELDS = ("distributed.", "mesh.", "model.remat", "model.attention_impl",
                 "model.attention_block_q", "model.attention_block_k", "train.compilation_cache")
# Fields that a resumed run may change without the override: they do not change what the steps
# already taken mean.
SAFE_CHANGES = ("train.num_steps", "train.eval_every", "train.eval_instances_per_task",
                "train.checkpoint_every", "train.checkpoint_keep", "train.log_every",
                "train.tensorboard", "train.plots", "train.export_hf",
                "train.allow_config_change", "train.wandb_project", "tasks.env_backend",
                "tasks.env_workers", "tasks.step_timeout_s") + LAYOUT_FIELDS
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "numpy",
            "ml_collections")


class WorkdirConflict(ValueError):
  """The workdir holds a run with another config."""


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """{"train.num_steps": 30, ...} of a nested dict; lists and empty dicts stay values."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
  """{dotted field: (old value, new value)} for every field that differs (missing = None)."""
  a, b = flatten(old), flatten(new)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def recorded_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
  """`config_changes` of the fields the old record has: a field it lacks was added by a newer
  eppo_jax, not changed by the user."""
  recorded = set(flatten(old))
  return {k: v for k, v in config_changes(old, new).items() if k in recorded}


def is_safe(field: str, allowed=SAFE_CHANGES) -> bool:
  return any(field == s or (s.endswith(".") and field.startswith(s)) for s in allowed)


def _versions() -> dict[str, str | None]:
  out = {}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def run_info() -> dict:
  """What this process runs on: package versions, Python, platform, devices, start time."""
  devices = jax.devices()
  return {
      "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "packages": _versions(),
      "python": sys.version.split()[0],
      "platform": platform.platform(),
      "machine": platform.machine(),
      "device_kind": devices[0].device_kind if devices else None,
      "device_count": jax.device_count(),
      "process_count": jax.process_count(),
  }


def claim(config: ml_collections.ConfigDict, workdir, write: bool = True) -> dict:
  """Checks `config` against the run recorded in `workdir`, then records it (when `write`).

  Returns the changed fields ({} for a fresh workdir or an identical config). Raises
  `WorkdirConflict` before writing anything if a change is not allowed.
  """
  workdir = Path(workdir)
  new = json.loads(config.to_json())
  path = workdir / CONFIG_FILE
  changes = {}
  if path.exists():
    old = json.loads(path.read_text())
    changes = config_changes(old, new)
    unsafe = {k: v for k, v in recorded_changes(old, new).items() if not is_safe(k)}
    if unsafe and not config.train.allow_config_change:
      listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in unsafe.items())
      raise WorkdirConflict(
          f"{workdir} holds a run with another config ({listed}). Use a new --workdir, or pass "
          "--config.train.allow_config_change=True to continue this run with the new config.")
  if write:
    workdir.mkdir(parents=True, exist_ok=True)
    info = run_info()
    info_path = workdir / RUN_INFO_FILE
    if info_path.exists():
      old_info = json.loads(info_path.read_text())
      info["previous_starts"] = old_info.pop("previous_starts", []) + [old_info]
    if changes:
      info["config_changes"] = {k: list(v) for k, v in changes.items()}
    _write(info_path, info)
    _write(path, new)
  return changes


def _write(path: Path, obj: Any) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
  tmp.replace(path)  # Never a half-written record, whenever the process dies.
