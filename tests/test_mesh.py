"""A (data=2, fsdp=2, tensor=2) mesh of 8 CPU devices computes what 1 device computes.

The 8-device checks run in a subprocess (the test session itself has 4 devices, see conftest):
3 `train_step`s (each group's prompt shared) and an SFT step with LoRA, a greedy multi-turn
rollout through `ModelPolicy`, and a checkpoint written on one mesh and restored on another, each
against a 1-device mesh.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eppo_jax import mesh as meshlib

ROOT = Path(__file__).resolve().parents[1]


def test_mesh_shape_resolves_and_refuses():
  assert meshlib.mesh_shape(meshlib.MeshConfig(-1, 2, 2), 16) == (4, 2, 2)
  assert meshlib.mesh_shape(meshlib.MeshConfig(2, -1, 1), 8) == (2, 4, 1)
  for bad in [(-1, -1, 1), (3, 1, 1), (0, 1, 1), (-1, 3, 1)]:
    with pytest.raises(ValueError, match="config.mesh"):
      meshlib.mesh_shape(meshlib.MeshConfig(*bad), 8)


def test_layout_rules_follow_the_parameter_path():
  mesh = meshlib.make_mesh(meshlib.MeshConfig(1, 2, 2), jax.devices()[:4])
  k = jax.tree_util.DictKey
  spec = lambda names, shape: meshlib.param_spec([k(n) for n in names], shape, mesh)
  layer = ("params", "layers")
  assert spec(layer + ("self_attn", "q_proj", "kernel"), (2, 32, 64)) == P(None, "fsdp", "tensor")
  assert spec(layer + ("self_attn", "q_proj", "bias"), (2, 64)) == P(None, "tensor")
  assert spec(layer + ("self_attn", "o_proj", "kernel"), (2, 64, 32)) == P(None, "tensor", "fsdp")
  assert spec(layer + ("mlp", "down_proj", "lora_a"), (2, 96, 4)) == P(None, "tensor", None)
  assert spec(layer + ("mlp", "down_proj", "lora_b"), (2, 4, 32)) == P(None, None, "fsdp")
  assert spec(layer + ("mlp", "up_proj", "lora_b"), (2, 4, 96)) == P(None, None, "tensor")
  assert spec(("params", "embed_tokens", "embedding"), (96, 32)) == P("tensor", "fsdp")
  assert spec(("params", "lm_head", "kernel"), (32, 96)) == P("fsdp", "tensor")
  assert spec(layer + ("input_layernorm", "scale"), (2, 32)) == P(None, None)
  # A dimension the axis does not divide stays whole on that axis.
  assert spec(layer + ("self_attn", "k_proj", "kernel"), (2, 33, 3)) == P(None, None, None)
  # Optimizer moments mirror their parameter: the rule reads the names along the path.
  opt_path = [jax.tree_util.SequenceKey(1), jax.tree_util.GetAttrKey("mu"),
              *[k(n) for n in layer + ("self_attn", "v_proj", "kernel")]]
  assert meshlib.param_spec(opt_path, (2, 32, 16), mesh) == P(None, "fsdp", "tensor")
  assert meshlib.param_spec([jax.tree_util.GetAttrKey("step")], (), mesh) == P()


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  """Results of `mesh_check.py` run on 8 forced CPU devices."""
  out = tmp_path_factory.mktemp("mesh") / "result.json"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_check.py"), str(out),
                         str(out.parent / "ckpt")], env=env, capture_output=True, text=True,
                        timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text())


def test_sharded_train_step_matches_one_device(eight_devices):
  r = eight_devices
  assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert r["sharded_leaves"] > 0  # The adapters and moments really were split.
  assert r["train_max_abs_diff"] <= 1e-5, r["train_max_abs_diff"]
  assert r["sft_max_abs_diff"] <= 1e-5, r["sft_max_abs_diff"]
  assert r["update_size"] > 1e-4  # The 3 steps moved the adapters: the comparison is not vacuous.
  for name, (one, eight) in r["metrics"].items():
    np.testing.assert_allclose(eight, one, rtol=1e-5, atol=1e-5, err_msg=name)


def test_sharded_greedy_rollout_matches_one_device(eight_devices):
  r = eight_devices
  assert r["rollout_equal"]
  assert r["rollout_tokens"] > 0


def test_checkpoint_moves_between_meshes(eight_devices):
  r = eight_devices
  assert r["restored_specs_follow_target"]
  assert r["restore_max_abs_diff"] == 0.0
