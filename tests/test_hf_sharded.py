"""Weights read straight into their mesh shardings, and the streamed HF export of sharded params."""

import json
import re

import flax.traverse_util as tu
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from safetensors import safe_open

import eppo_jax
from eppo_jax import lora
from eppo_jax import hosts
from eppo_jax import mesh as meshlib
from eppo_jax.models import hf
from eppo_jax.models.config import LoraConfig

from conftest import fast_logits, hf_logits, left_padded_batch, max_valid_diff

MESHES = {"fsdp2_tensor2": meshlib.MeshConfig(1, 2, 2), "fsdp4": meshlib.MeshConfig(1, 4, 1)}
LORA = LoraConfig(rank=4, alpha=8.0)


def _mesh(name):
  return meshlib.make_mesh(MESHES[name], jax.devices()[:4])


def _expected_shard_shape(shape, spec, mesh):
  """Each dimension divided by the mesh axis its spec names (whole where none)."""
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  return tuple(n // mesh.shape[a] if a is not None else n for n, a in zip(shape, spec))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("variant", ["llama", "qwen2_oldstyle", "qwen3"])
def test_load_places_each_leaf_in_its_sharding(hf_checkpoints, monkeypatch, mesh_name, variant):
  """Shardings from the layout rules, values bitwise those of the unsharded load, each device
  holding only its block; split leaves are never read whole, replicated ones once."""
  _, model_dir = hf_checkpoints(variant)
  mesh = _mesh(mesh_name)
  reads = []
  real_read = hf._read_block
  monkeypatch.setattr(hf, "_read_block", lambda entries, where, bounds, dtype: (
      reads.append((entries[0][1].path, bounds)), real_read(entries, where, bounds, dtype))[1])
  sharded = eppo_jax.load_pretrained(model_dir, with_tokenizer=False, mesh=mesh).params
  monkeypatch.setattr(hf, "_read_block", real_read)
  plain = eppo_jax.load_pretrained(model_dir, with_tokenizer=False).params

  want = meshlib.shardings(plain, mesh)
  flat, flat_plain, flat_want = (tu.flatten_dict(t) for t in (sharded, plain, want))
  assert flat.keys() == flat_plain.keys()
  split = 0
  for path, leaf in flat.items():
    full = np.asarray(flat_plain[path])
    assert leaf.sharding == flat_want[path], path
    np.testing.assert_array_equal(np.asarray(leaf), full)
    shard_shape = _expected_shard_shape(full.shape, flat_want[path].spec, mesh)
    assert len(leaf.addressable_shards) == 4
    for shard in leaf.addressable_shards:
      assert shard.data.shape == shard_shape, path
      np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    blocks = [b for p, b in reads if ("params",) + p == path]
    if shard_shape != full.shape:
      split += 1
      whole = tuple((0, n) for n in full.shape)
      assert whole not in blocks, f"{path} was read whole"
      assert len(set(blocks)) == len(blocks), f"{path}: a block was read twice"
    else:
      assert len(blocks) == 1, f"{path}: replicated leaf read {len(blocks)} times"
  assert split >= 8  # The mesh does split the projections and embeddings.


def _adapted(pre, mesh=None, seed=0):
  """(config, params) with random LoRA adapters (B != 0), put on `mesh`'s shardings if given."""
  config, params = lora.add_lora(pre.params, pre.config, LORA, jax.random.PRNGKey(seed))
  flat = tu.flatten_dict(params)
  key = jax.random.PRNGKey(seed + 1)
  for i, path in enumerate(sorted(p for p in flat if p[-1] == "lora_b")):
    flat[path] = 0.3 * jax.random.normal(jax.random.fold_in(key, i), flat[path].shape)
  params = tu.unflatten_dict(flat)
  if mesh is not None:
    params = hosts.put(params, meshlib.shardings(params, mesh))
  return config, params


def _read_export(out_dir):
  """{HF name: array} of an export directory, from its index (or single file)."""
  index = out_dir / "model.safetensors.index.json"
  files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
           else ["model.safetensors"])
  tensors = {}
  for file in files:
    with safe_open(str(out_dir / file), framework="numpy") as f:
      tensors.update({name: f.get_tensor(name) for name in f.keys()})
  return tensors


def _numpy_reference(torch_model, params, scale, dtype):
  """The merged HF tensors: the torch model's weights in `dtype`, W + (A @ B) * scale per layer."""
  adapters = tu.flatten_dict(jax.tree_util.tree_map(np.asarray, params["params"]))
  out = {}
  for name, value in torch_model.state_dict().items():
    value = value.numpy().astype(dtype)
    match = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.(\w+)\.weight", name)
    if match and ("layers", match[2], match[3], "lora_a") in adapters:
      layer, owner = int(match[1]), ("layers", match[2], match[3])
      a = adapters[owner + ("lora_a",)][layer].astype(np.float32)
      b = adapters[owner + ("lora_b",)][layer].astype(np.float32)
      kernel = value.T.astype(np.float32)  # HF stores [out, in].
      value = np.ascontiguousarray((kernel + (a @ b) * np.float32(scale)).astype(dtype).T)
    out[name] = value
  return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_streamed_export_of_sharded_params_equals_numpy_merge(hf_checkpoints, tmp_path, dtype):
  """Every exported tensor is bitwise the NumPy merge of the checkpoint and the adapters."""
  torch_model, model_dir = hf_checkpoints("llama")
  mesh = _mesh("fsdp2_tensor2")
  pre = eppo_jax.load_pretrained(model_dir, dtype=dtype, with_tokenizer=False, mesh=mesh)
  config, params = _adapted(pre, mesh)
  out = eppo_jax.export_hf(params, config, str(tmp_path / "export"), max_shard_bytes=20_000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2
  got = _read_export(out)
  want = _numpy_reference(torch_model, params, LORA.scale, np.dtype(dtype))
  assert got.keys() == want.keys() == index["weight_map"].keys()
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
  for name, value in want.items():
    assert got[name].dtype == value.dtype, name
    np.testing.assert_array_equal(got[name].view(np.uint8), value.view(np.uint8), err_msg=name)
  # And the on-device merge agrees to rounding (same formula, another matmul).
  merged = lora.merge(jax.device_get(params), config)["params"]
  np.testing.assert_allclose(
      np.asarray(merged["layers"]["mlp"]["up_proj"]["kernel"][1], np.float32),
      got["model.layers.1.mlp.up_proj.weight"].astype(np.float32).T, rtol=1e-2 if
      dtype == jnp.bfloat16 else 1e-6, atol=1e-6)


def test_export_from_sharded_params_round_trips_through_transformers(hf_checkpoints, tmp_path):
  """An adapted, fsdp x tensor-sharded Qwen2 exports to a model `transformers` runs identically."""
  import transformers  # pylint: disable=g-import-not-at-top
  _, model_dir = hf_checkpoints("qwen2_oldstyle")
  mesh = _mesh("fsdp2_tensor2")
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False, mesh=mesh)
  config, params = _adapted(pre, mesh, seed=5)
  tokens, mask = left_padded_batch(pre.config.vocab_size, (40, 25), seed=4)
  ours = np.asarray(fast_logits(jax.device_get(params), config, tokens, mask))
  out = eppo_jax.export_hf(params, config, tmp_path / "export")
  assert (out / "model.safetensors").exists()
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
  assert max_valid_diff(hf_logits(model.float().eval(), tokens, mask), ours, mask) < 1e-4



def test_export_through_epath_copies_weights_and_tokenizer(hf_checkpoints, small_tokenizer,
                                                          tmp_path, monkeypatch):
  """The remote-path route (write a local temporary file, copy it with epath) exports the same."""
  _, model_dir = hf_checkpoints("qwen3")
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False, mesh=_mesh("fsdp4"))
  copied = []
  path_type = type(epath.Path(tmp_path))
  real_copy = path_type.copy
  monkeypatch.setattr(hf.workdir_lib, "url_scheme", lambda path: "gs")
  monkeypatch.setattr(path_type, "copy", lambda self, dst, overwrite=False: (
      copied.append(epath.Path(dst).name), real_copy(self, dst, overwrite=overwrite))[1])
  out = eppo_jax.export_hf(pre.params, pre.config, epath.Path(tmp_path / "export"),
                           small_tokenizer, max_shard_bytes=30_000)
  weights = sorted(p.name for p in out.glob("model-*.safetensors"))
  assert len(weights) > 1 and set(weights) | {"tokenizer.json"} <= set(copied)
  again = eppo_jax.load_pretrained(out)
  assert again.tokenizer.get_vocab() == small_tokenizer.get_vocab()
  jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, jax.device_get(pre.params))
