"""Shared by test_agent.py and test_train.py: the smoke tiny model, smoke configs, small helpers."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from eppo_jax import lora, pacing, programs, steps, train

ROOT = Path(__file__).resolve().parents[1]


def _config_module():
  """configs/multitask.py, loaded by path (the repo root need not be on sys.path)."""
  path = ROOT / "configs" / "multitask.py"
  spec = importlib.util.spec_from_file_location("multitask_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


get_config = _config_module().get_config


def smoke_config(tiny_dir, **overrides) -> ml_collections.ConfigDict:
  """The `smoke` preset on the prebuilt tiny model; `overrides` are "section.field" -> value."""
  config = get_config("smoke")
  config.model.tiny_dir = str(tiny_dir)
  for dotted, value in overrides.items():
    section, _, field = dotted.rpartition(".")
    node = config
    for name in section.split(".") if section else ():
      node = node[name]
    node[field] = value
  return config


def _model_dir(tmp_path_factory) -> Path:
  """Builds the smoke tiny model once per session (or reuses a build with the same fingerprint)."""
  directory = tmp_path_factory.getbasetemp() / "smoke_tiny_model"
  train.load_model(smoke_config(directory), directory)
  return directory


@pytest.fixture(scope="session")
def smoke_tiny_dir(tmp_path_factory) -> Path:
  """Directory of the smoke preset's tiny model (HF format), built once."""
  return _model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> dict:
  """A persistent XLA cache shared by this process and the training subprocesses.

  The runs below compile the same programs again and again (each `train()` builds its own pmap);
  the cache only skips recompiling identical programs. Returns the environment for subprocesses.
  """
  directory = str(tmp_path_factory.getbasetemp() / "xla_cache")
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=directory,
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")


def state_like(config, workdir) -> steps.TrainState:
  """A TrainState of the run's structure (what `Checkpointer.restore` fills in)."""
  _, params, _ = train.load_model(config, Path(workdir))
  trainable, _ = lora.partition(params, lora.trainable_mask(
      params, full_finetune=not config.model.lora_rank))
  o = config.optim
  tx = programs.make_optimizer(o.learning_rate, o.warmup_steps, o.weight_decay, o.grad_clip)
  return steps.TrainState(step=np.zeros((), np.int32), trainable=trainable,
                          opt_state=tx.init(trainable),
                          pacing=pacing.init_pacing(len(config.tasks.specs)))


def assert_trees_equal(a, b) -> None:
  """Bit-for-bit equality of two pytrees of arrays (same structure, dtypes and values)."""
  leaves_a, tree_a = jax.tree_util.tree_flatten(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)
    assert x.tobytes() == y.tobytes()  # Also tells -0.0 from 0.0 and NaN payloads apart.


def runs(mask) -> list[tuple[int, int]]:
  """(start, end) of each maximal run of True in a 1-D mask."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, int), [0]])))
  return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def read_records(workdir: Path) -> list[dict]:
  """A run's log records (its metrics.jsonl), in order."""
  with open(Path(workdir) / "metrics.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]
