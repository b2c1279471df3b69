"""`python -m eppo_jax.fit` on 8 CPU devices: the bytes it reports are those of the shards it placed.

Compiling for a TPU topology takes minutes per program on a small CPU, so the suite checks the tool
on `cpu:8` with the smoke preset; docs/scaling.md has the TPU command.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from eppo_jax import fit, lora, mesh as meshlib, pacing, programs, steps
from eppo_jax.models.transformer import init_params

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import multitask  # pylint: disable=g-import-not-at-top,wrong-import-position


def _shard_bytes(tree, mesh) -> int:
  """Bytes one device holds of `tree` under the layout rules, counted shard by shard."""
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    spec = meshlib.param_spec(path, x.shape, mesh)
    shape = list(x.shape)
    for i, axes in enumerate(spec):
      for a in (axes,) if isinstance(axes, str) else (axes or ()):
        shape[i] //= mesh.shape[a]
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def test_fit_reports_the_per_device_bytes_of_the_sharded_train_step(tmp_path):
  out = tmp_path / "fit.json"
  cmd = [sys.executable, "-m", "eppo_jax.fit", "--config=configs/multitask.py:smoke",
         "--topology=cpu:8", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
         "--config.model.lora_rank=4", "--programs=train", "--hbm_gib=0.001", f"--json={out}"]
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                        check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]  # 1 MiB per device cannot hold it.
  assert "train_step" in proc.stdout and "does not fit" in proc.stdout, proc.stdout
  result = json.loads(out.read_text())
  assert result["devices"] == 8 and result["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  # Whole rows, and each group's prompt run once (the smoke preset shares prompts).
  train_fit, shared_fit = result["fits"]
  assert train_fit["program"] == "train_step" and shared_fit["program"] == "train_shared"
  assert not train_fit["error"] and not shared_fit["error"]
  assert shared_fit["arguments"] == train_fit["arguments"]  # Same state, weights and batch.

  # The same inputs, sized shard by shard here: state, frozen weights and batch rows.
  config = multitask.get_config("smoke")
  config.model.lora_rank = 4
  model_cfg = fit.model_config(config)
  mesh = AbstractMesh((2, 2, 2), meshlib.AXES)
  params = jax.eval_shape(lambda k: init_params(model_cfg, k),
                          jax.ShapeDtypeStruct((2,), jnp.uint32))
  trainable, frozen = lora.partition(params, lora.trainable_mask(params))
  o = config.optim
  tx = programs.make_optimizer(o.learning_rate, o.warmup_steps, o.weight_decay, o.grad_clip)
  state = jax.eval_shape(lambda t: steps.TrainState(
      step=jnp.zeros((), jnp.int32), trainable=t, opt_state=tx.init(t),
      pacing=pacing.init_pacing(len(config.tasks.specs))), trainable)
  b, t = config.rollout.instances_per_step * config.rollout.group_size, \
      config.rollout.max_episode_tokens
  rows = b // 4  # data x fsdp
  batch_bytes = rows * t * (4 + 1 + 1) + rows * (4 + 4 + 4)
  # The key (2 x uint32) only with a second PPO epoch, which shuffles: with one epoch the eppo
  # loss draws no random numbers, and jit drops unused arguments.
  key_bytes = 8 if o.ppo_epochs > 1 else 0
  expected = _shard_bytes(state, mesh) + _shard_bytes(frozen, mesh) + batch_bytes + key_bytes
  assert train_fit["arguments"] == expected
  # The layout really split the weights (a wrong rule table would leave them whole).
  assert 2 * _shard_bytes(frozen, mesh) < _shard_bytes(frozen, AbstractMesh((1, 1, 1),
                                                                           meshlib.AXES))
