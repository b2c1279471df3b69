"""One run per workdir: the workdir records its config and software, and refuses another config.

`claim(config, workdir)` runs before anything is written. A fresh workdir gets `config.json` (the
full config) and `run_info.json` (package versions, Python, platform, devices, start time). A rerun
with the same config resumes; a rerun whose config differs only in fields of `SAFE_CHANGES` (how
long to train, how often to log or save, how environments are stepped, how the same model is laid
out and computed: mesh, remat, attention kernel) resumes with the new values; any other change is
refused with the changed fields listed, unless `config.train.allow_config_change` is True.

A workdir is a local path or a URL (gs://bucket/run): every module reaches it through `as_path`, an
`etils.epath.Path` (orbax's own path type), so all hosts of a pod share one workdir on GCS.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any, Optional

from etils import epath
import jax
import ml_collections

CONFIG_FILE = "config.json"
RUN_INFO_FILE = "run_info.json"
# Fields that change how the same computation is laid out and run, not what it computes (results
# differ by rounding at most). A prefix ending in "." covers a whole section.
LAYOUT_FIELDS = ("distributed.", "mesh.", "model.remat", "model.attention_impl",
                 "model.attention_block_q", "model.attention_block_k", "train.compilation_cache",
                 "optim.micro_batches")
# Fields that a resumed run may change without the override: they do not change what the steps
# already taken mean.
SAFE_CHANGES = ("train.num_steps", "train.eval_every", "train.eval_instances_per_task",
                "train.checkpoint_every", "train.checkpoint_keep", "train.log_every",
                "train.tensorboard", "train.plots", "train.export_hf",
                "train.allow_config_change", "train.wandb_project", "tasks.env_backend",
                "tasks.env_workers", "tasks.step_timeout_s") + LAYOUT_FIELDS
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "numpy",
            "ml_collections")


# Packages a URL workdir needs besides etils.epath: the fsspec filesystem epath reaches it with and,
# for gs://, the GCS client orbax lists checkpoints with. The `gcs` extra installs both.
URL_PACKAGES = {"gs": ("gcsfs", "google.cloud.storage")}
URL_EXTRAS = {"gs": "gcs"}


class WorkdirConflict(ValueError):
  """The workdir holds a run with another config."""


class WorkdirUnusable(ValueError):
  """The workdir is a URL that this installation cannot reach."""


def url_scheme(path) -> Optional[str]:
  """"gs" of "gs://bucket/run"; None of a local path."""
  scheme, sep, _ = os.fspath(path).partition("://")
  return scheme if sep else None


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # A parent package ("google" of "google.cloud.storage") is missing.
    return False


def as_path(workdir) -> epath.Path:
  """`workdir` (a local path, or a URL such as gs://bucket/run) as an `etils.epath.Path`.

  Raises `WorkdirUnusable` in one line for a URL whose packages are not installed, before anything
  is read or written (`pathlib` would turn the URL into a local `gs:/...` folder on each host).
  """
  scheme = url_scheme(workdir)
  if scheme is not None:
    missing = [m for m in URL_PACKAGES.get(scheme, ()) if not _importable(m)]
    if missing:
      extra = URL_EXTRAS.get(scheme)
      hint = f"pip install 'eppo_jax[{extra}]'" if extra else "pip install " + " ".join(missing)
      raise WorkdirUnusable(f"workdir {workdir} needs {', '.join(missing)}, not installed: {hint}")
  try:
    return epath.Path(workdir)
  except KeyError:  # epath knows no class for this URL scheme.
    raise WorkdirUnusable(f"workdir {workdir}: epath reaches local paths and gs://, s3://, az://, "
                          f"hf:// URLs, not {scheme}://") from None


def absolute(path) -> epath.Path:
  """`as_path(path)`, a relative local path joined to the current directory (as
  `pathlib.Path.absolute` does: no `..` resolved); a URL as it is."""
  path = as_path(path)
  if url_scheme(path) is None and not path.is_absolute():
    return epath.Path(os.getcwd()) / path
  return path


def tiny_model_dir(workdir) -> epath.Path:
  """Where the tiny model of a run without `config.model.tiny_dir` is kept: `workdir/tiny_model`
  (a URL for a URL workdir: `local_copy` is where each host reads it)."""
  return as_path(workdir) / "tiny_model"


def local_copy(url) -> epath.Path:
  """This host's directory for a copy of the directory at `url` (`transformers` reads local files
  only): its cache, under the URL's scheme and path."""
  path = as_path(url)
  cache = os.path.join(os.path.expanduser("~"), ".cache", "eppo_jax", "workdirs")
  return epath.Path(cache, url_scheme(path), os.fspath(path).split("://", 1)[1].strip("/"))


def mirror(src, dst, stamp: str) -> bool:
  """Copies the files of directory `src` into `dst` (either may be a URL) unless `dst` already
  holds the same `stamp` file, which is copied last, so that an interrupted copy is redone ->
  whether it copied."""
  src, dst = as_path(src), as_path(dst)
  if (dst / stamp).exists() and (dst / stamp).read_bytes() == (src / stamp).read_bytes():
    return False
  dst.mkdir(parents=True, exist_ok=True)
  for path in sorted(src.iterdir()):
    if path.name != stamp and path.is_file():
      (dst / path.name).write_bytes(path.read_bytes())
  (dst / stamp).write_bytes((src / stamp).read_bytes())
  return True


def write_atomic(path, text: str) -> None:
  """Writes `text` to `path` (local or URL) through a temporary file and a rename: never a
  half-written file, whenever the process dies."""
  path = as_path(path)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(text)
  tmp.replace(path)  # On GCS a server-side copy: the object appears whole or not at all.


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
  workdir = as_path(workdir)
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


def _write(path: epath.Path, obj: Any) -> None:
  write_atomic(path, json.dumps(obj, indent=1, sort_keys=True, default=str))
