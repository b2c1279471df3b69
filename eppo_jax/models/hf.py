"""HF checkpoints <-> (ModelConfig, params, tokenizer): tensor-by-tensor safetensors I/O, no torch."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from eppo_jax import lora
from eppo_jax import hosts
from eppo_jax import mesh as meshlib
from eppo_jax import workdir as workdir_lib
from eppo_jax.models.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}
# Buffers some exporters write that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class Pretrained:
  config: ModelConfig
  params: Any
  tokenizer: Any
  path: Path


def resolve_model_dir(path_or_hub_id: str | os.PathLike) -> Path:
  """A local directory as is; a hub id through the local HF cache only (never downloads)."""
  path = Path(path_or_hub_id).expanduser()
  if path.is_dir():
    return path
  if path.exists():
    hint = (f"; convert a GGUF first: python -m eppo_jax.models.gguf {path} OUT_DIR"
            if path.suffix == ".gguf" else "")
    raise ValueError(f"{path} is a file; pass the model directory that holds config.json{hint}")
  name = str(path_or_hub_id)
  # Imported here: `python -m eppo_jax.models.gguf` must not find the module already imported.
  from eppo_jax.models import gguf  # pylint: disable=g-import-not-at-top
  if make := gguf.conversion_command(name):  # A directory converted from a registry package.
    raise FileNotFoundError(f"no model directory at {name!r} (from {os.getcwd()}); make it "
                            f"first: {make}")
  if name.count("/") != 1 or name.startswith((".", "/")):
    raise FileNotFoundError(f"no model directory at {name!r} (and it is not a hub id 'org/name')")
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top
  try:
    return Path(snapshot_download(name, local_files_only=True))
  except Exception as e:  # The hub raises several types for "not cached".
    raise FileNotFoundError(
        f"{name!r} is not in the local Hugging Face cache and this loader never downloads. "
        f"Fetch it first where the hub is reachable (`hf download {name}`) or pass "
        f"a local directory.") from e


def config_from_hf(hf: dict, *, dtype: str = "float32", param_dtype: Optional[str] = None,
                   source: str = "config.json") -> ModelConfig:
  """Maps an HF `config.json` dict onto ModelConfig; unsupported architectures are refused."""
  archs = hf.get("architectures") or []
  arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
  if arch is None:
    raise ValueError(f"{source}: architectures {archs} are not supported; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  if hf.get("mlp_bias"):
    raise ValueError(f"{source}: mlp_bias=true is not supported")
  if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
    raise ValueError(f"{source}: Llama with attention_bias=true (o_proj bias) is not supported")
  # transformers >= 5 nests RoPE settings in `rope_parameters`; older files use two top-level keys.
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(hf.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
  rope.pop("rope_theta", None)
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    rope = {}
  elif kind not in ("linear", "llama3"):
    raise ValueError(f"{source}: rope type {kind!r} is not supported (default, linear, llama3)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (silu)")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=head_dim,
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=theta,
      rope_scaling=tuple(sorted(rope.items())) or None,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
      qk_norm=arch == "Qwen3ForCausalLM",
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      architecture=arch,
      dtype=dtype,
      param_dtype=param_dtype or dtype,
  )


def config_to_hf(config: ModelConfig, tokenizer=None) -> dict:
  """The `config.json` that `transformers` needs to rebuild this model."""
  hf = {
      "architectures": [config.architecture],
      "model_type": _MODEL_TYPES[config.architecture],
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": config.rope_scaling_dict or None,
      "tie_word_embeddings": config.tie_word_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "torch_dtype": config.param_dtype,
  }
  if config.architecture == "Qwen3ForCausalLM":
    hf["attention_bias"] = config.attention_bias
  if tokenizer is not None:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
      hf[key] = getattr(tokenizer, key, None)
  return hf


@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where one HF tensor goes: a param path, a layer index (None if unstacked), a transpose flag."""

  path: tuple[str, ...]
  layer: Optional[int]
  transpose: bool
  hf_shape: tuple[int, ...]


def _tensor_map(config: ModelConfig) -> dict[str, _Slot]:
  """Every tensor the checkpoint must hold for `config`, keyed by its HF name."""
  d, f, v, h = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
  q, kv = config.num_heads * h, config.num_kv_heads * h
  out = {"model.embed_tokens.weight": _Slot(("embed_tokens", "embedding"), None, False, (v, d)),
         "model.norm.weight": _Slot(("norm", "scale"), None, False, (d,))}
  if not config.tie_word_embeddings:
    out["lm_head.weight"] = _Slot(("lm_head", "kernel"), None, True, (v, d))
  linears = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
             "self_attn.o_proj": (d, q), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
             "mlp.down_proj": (d, f)}
  for i in range(config.num_layers):
    pre = f"model.layers.{i}."
    for name, shape in linears.items():
      path = ("layers",) + tuple(name.split("."))
      out[pre + name + ".weight"] = _Slot(path + ("kernel",), i, True, shape)
      if config.attention_bias and name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
        out[pre + name + ".bias"] = _Slot(path + ("bias",), i, False, (shape[0],))
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out[pre + norm + ".weight"] = _Slot(("layers", norm, "scale"), i, False, (d,))
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        out[pre + f"self_attn.{norm}.weight"] = _Slot(("layers", "self_attn", norm, "scale"), i,
                                                      False, (h,))
  return out


def _weight_files(model_dir: Path) -> list[Path]:
  index = model_dir / "model.safetensors.index.json"
  if index.exists():
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [model_dir / s for s in shards]
  single = model_dir / "model.safetensors"
  if single.exists():
    return [single]
  raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                          "(only safetensors checkpoints are supported)")


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _aligned_empty(shape: tuple[int, ...], dtype, alignment: int = 64) -> np.ndarray:
  """`np.empty` whose data starts on an `alignment`-byte boundary.

  `jax.device_put` on the CPU backend adopts such a buffer without copying it (numpy's own
  allocations are only 16-byte aligned, so they get copied), so a loaded leaf exists once in host
  memory instead of twice while it is handed over. Other backends copy to the device either way.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  start = -raw.ctypes.data % alignment
  return raw[start:start + nbytes].view(dtype).reshape(shape)


@contextlib.contextmanager
def _open_weights(file: Path):
  """`safe_open(file)`, with any read error (a truncated or corrupt file) naming the file."""
  try:
    with safe_open(file, framework="numpy") as f:
      yield f
  except (OSError, ValueError, RuntimeError, SafetensorError) as e:
    raise ValueError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e}); it may be "
                     "truncated or corrupt: download or export it again") from e


def _check_checkpoint(model_dir: Path, config: ModelConfig,
                      tensor_map: dict[str, _Slot]) -> dict[str, Path]:
  """The file of every HF tensor; refuses partial or mis-shaped checkpoints before any read."""
  files = _weight_files(model_dir)
  where: dict[str, Path] = {}
  shapes: dict[str, tuple] = {}
  for file in files:
    if not file.exists():
      raise FileNotFoundError(f"{file}: shard listed in the index is missing")
    with _open_weights(file) as f:
      for name in f.keys():
        where[name] = file
        shapes[name] = tuple(f.get_slice(name).get_shape())
  missing = sorted(set(tensor_map) - set(where))
  unexpected = sorted(n for n in set(where) - set(tensor_map)
                      if not n.endswith(_IGNORED_SUFFIXES)
                      and not (config.tie_word_embeddings and n == "lm_head.weight"))
  misshaped = sorted(f"{n}: file {shapes[n]} vs expected {tensor_map[n].hf_shape}"
                     for n in set(where) & set(tensor_map) if shapes[n] != tensor_map[n].hf_shape)
  if missing or unexpected or misshaped:
    raise ValueError(
        f"checkpoint {model_dir} does not match its config.json ({config.architecture}):\n"
        f"  missing tensors: {missing[:20]}{' ...' if len(missing) > 20 else ''}\n"
        f"  unexpected tensors: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}\n"
        f"  mis-shaped tensors: {misshaped}\n  files: {[str(p) for p in files]}")
  return where


def _leaf_shape(slot: _Slot, config: ModelConfig) -> tuple[int, ...]:
  """The param leaf's shape: the HF shape transposed where needed, layers stacked in front."""
  shape = slot.hf_shape[::-1] if slot.transpose else slot.hf_shape
  return shape if slot.layer is None else (config.num_layers,) + shape


def _read_block(entries: list[tuple[str, _Slot]], where: dict[str, Path],
                bounds: tuple[tuple[int, int], ...], dtype) -> np.ndarray:
  """The block `bounds` ((start, stop) per leaf axis) of one leaf, read from its HF tensors.

  Only the rows and columns inside the block are read (`get_slice`), and only the layers it spans.
  """
  block = _aligned_empty(tuple(stop - start for start, stop in bounds), dtype)
  stacked = entries[0][1].layer is not None
  inner = bounds[1:] if stacked else bounds
  for name, slot in entries:
    if stacked and not bounds[0][0] <= slot.layer < bounds[0][1]:
      continue
    index = tuple(slice(start, stop) for start, stop in inner)
    # Open per tensor: the file is memory-mapped, and closing unmaps the pages just read, so
    # they do not accumulate in the process's resident set.
    with _open_weights(where[name]) as f:
      part = f.get_slice(name)[index[::-1] if slot.transpose else index]
    # One copy per tensor: transposition and dtype conversion happen while writing the block.
    block[slot.layer - bounds[0][0] if stacked else ()] = part.T if slot.transpose else part
    del part
  return block


def _place_leaf(path: tuple[str, ...], entries: list[tuple[str, _Slot]], where: dict[str, Path],
                config: ModelConfig, mesh: Optional[Mesh]) -> jax.Array:
  """One param leaf on the default device, or split over `mesh` by its layout rule."""
  shape = _leaf_shape(entries[0][1], config)
  dtype = config.weight_dtype
  if mesh is None:
    # `device_put`, not `jnp.asarray`: the latter always copies, doubling the leaf on the host.
    return jax.device_put(_read_block(entries, where, tuple((0, n) for n in shape), dtype))
  keys = tuple(jax.tree_util.DictKey(k) for k in ("params",) + path)
  sharding = NamedSharding(mesh, meshlib.param_spec(keys, shape, mesh))
  blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

  def read(index: tuple[slice, ...]) -> np.ndarray:
    # Called once per local device; devices holding the same block (replicas) share one read.
    bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
    if bounds not in blocks:
      blocks[bounds] = _read_block(entries, where, bounds, dtype)
    return blocks[bounds]

  return jax.make_array_from_callback(shape, sharding, read)


def load_params(model_dir: Path, config: ModelConfig, mesh: Optional[Mesh] = None) -> dict:
  """Reads every tensor once, stacking layers in place; refuses partial or mis-shaped checkpoints.

  With `mesh`, each leaf is created with its `mesh.param_spec` sharding: every device receives only
  its own block, read straight from the files, and each host reads only what its devices hold.
  """
  tensor_map = _tensor_map(config)
  where = _check_checkpoint(model_dir, config, tensor_map)
  # Group HF tensors by destination leaf so each stacked [L, ...] leaf is built once, moved to the
  # device and released: peak host memory stays near one leaf, not a second copy of the model.
  by_leaf: dict[tuple[str, ...], list[tuple[str, _Slot]]] = {}
  for name, slot in tensor_map.items():
    by_leaf.setdefault(slot.path, []).append((name, slot))
  params: dict = {}
  for path, entries in by_leaf.items():
    _set(params, path, _place_leaf(path, entries, where, config, mesh))
  return {"params": params}


# A layer of a stacked leaf, taken where the leaf lives: a sharded leaf stays sharded, so only one
# layer is ever gathered. The index is traced, so each leaf shape compiles once, not once per layer.
_take_layer = jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False))


def _host_layer(leaf, layer: Optional[int]) -> np.ndarray:
  """Layer `layer` of a leaf (the whole leaf if None) as NumPy; every host must call it together."""
  if not isinstance(leaf, jax.Array):
    leaf = np.asarray(leaf)
    return leaf if layer is None else leaf[layer]
  return hosts.fetch(leaf if layer is None else _take_layer(leaf, layer))


def _hf_tensor(params: dict, slot: _Slot, scale: float) -> np.ndarray:
  """One HF tensor on the host: its layer of the leaf, LoRA merged in, in HF orientation."""
  node = params
  for key in slot.path[:-1]:
    node = node[key]
  value = _host_layer(node[slot.path[-1]], slot.layer)
  if slot.path[-1] == "kernel" and "lora_a" in node:
    value = lora.merge_kernel(value, _host_layer(node["lora_a"], slot.layer),
                              _host_layer(node["lora_b"], slot.layer), scale)
  return np.ascontiguousarray(value.T if slot.transpose else value)


def _shard_plan(params: dict, config: ModelConfig,
                max_shard_bytes: int) -> list[list[tuple[str, _Slot]]]:
  """HF tensors grouped into files of at most `max_shard_bytes` (or one tensor each), by shape."""
  shards: list[list[tuple[str, _Slot]]] = [[]]
  size = 0
  for name, slot in _tensor_map(config).items():
    leaf = params
    for key in slot.path:
      leaf = leaf[key]
    nbytes = int(np.prod(slot.hf_shape)) * np.dtype(leaf.dtype).itemsize
    if size and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, slot))
    size += nbytes
  return shards


def _save_safetensors(tensors: dict[str, np.ndarray], dst: epath.Path) -> None:
  """`save_file` to a local file, or to a temporary one copied to a remote `dst`."""
  if workdir_lib.url_scheme(dst) is None:
    save_file(tensors, os.fspath(dst), metadata={"format": "pt"})
    return
  with tempfile.TemporaryDirectory() as tmp:
    local = Path(tmp) / dst.name
    save_file(tensors, str(local), metadata={"format": "pt"})
    epath.Path(local).copy(dst, overwrite=True)


def _save_tokenizer(tokenizer, out_dir: epath.Path) -> None:
  if workdir_lib.url_scheme(out_dir) is None:
    tokenizer.save_pretrained(os.fspath(out_dir))
    return
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer.save_pretrained(tmp)
    for file in Path(tmp).iterdir():
      epath.Path(file).copy(out_dir / file.name, overwrite=True)


def export_hf(params, config: ModelConfig, out_dir, tokenizer=None,
              max_shard_bytes: int = 4 << 30) -> epath.Path:
  """Writes safetensors (LoRA merged), config.json and the tokenizer; `transformers` loads it.

  Streams: one HF tensor at a time is fetched to the host (a sharded leaf's layer is gathered,
  never the whole model onto one device), merged with its adapter in NumPy and added to the
  current file, which is written when full; so the host holds at most one file plus one tensor.
  On several hosts every process must call this (each takes part in the gathers); only process 0
  writes. `out_dir` may be a local path or any `etils.epath` path or URL (e.g. `gs://...`).
  """
  out_dir = epath.Path(out_dir)
  writer = jax.process_index() == 0
  params = params["params"]
  shards = _shard_plan(params, config, max_shard_bytes)
  if writer:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Weights of an earlier export into the same directory must go: a stale index next to a new
    # single file (or stale shards next to a new index) would make readers disagree on the weights.
    for stale in [out_dir / "model.safetensors", out_dir / "model.safetensors.index.json",
                  *out_dir.glob("model-*-of-*.safetensors")]:
      stale.unlink(missing_ok=True)
  scale = config.lora.scale if config.lora is not None else 0.0
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map, total = {}, 0
  for fname, shard in zip(names, shards):
    tensors = {name: _hf_tensor(params, slot, scale) for name, slot in shard}
    if writer:
      _save_safetensors(tensors, out_dir / fname)
    weight_map.update({name: fname for name in tensors})
    total += sum(v.nbytes for v in tensors.values())
    del tensors
  if not writer:
    return out_dir
  if len(shards) > 1:
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  hf = config_to_hf(config, tokenizer)
  (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
  if tokenizer is not None:
    _save_tokenizer(tokenizer, out_dir)
  return out_dir


# Files from which `AutoTokenizer` builds a tokenizer: any one of these sets.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def load_tokenizer(model_dir: Path):
  """The directory's own tokenizer; refuses a directory without a usable one, naming what is
  missing (transformers would otherwise build an empty tokenizer, or ask for sentencepiece)."""
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  model_dir = Path(model_dir)
  if not any(all((model_dir / f).exists() for f in files) for files in TOKENIZER_FILES):
    wanted = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
    raise FileNotFoundError(f"{model_dir} has no tokenizer files (needs {wanted}); copy them from "
                            "the model's source, or pass with_tokenizer=False")
  tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
  if not tokenizer("hello world", add_special_tokens=False)["input_ids"]:
    raise ValueError(f"the tokenizer in {model_dir} encodes 'hello world' to nothing "
                     f"({len(tokenizer)} tokens in its vocabulary): its files are incomplete")
  if tokenizer.pad_token_id is None:
    # Padding positions are always masked, so any id works; EOS keeps the vocabulary unchanged.
    tokenizer.pad_token = tokenizer.eos_token
  return tokenizer


def load_pretrained(path_or_hub_id, dtype=jnp.float32, *, param_dtype=None,
                    with_tokenizer: bool = True, mesh: Optional[Mesh] = None) -> Pretrained:
  """Loads an HF Llama / Qwen2 / Qwen3 checkpoint: `.config`, `.params`, `.tokenizer`.

  With `mesh`, every weight is created split by `mesh.shardings` (each device reads just its block;
  no device ever holds a whole split leaf); without, the weights go to the default device.
  """
  model_dir = resolve_model_dir(path_or_hub_id)
  config_file = model_dir / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{config_file} is missing: not a Hugging Face model directory")
  dtype_name = jnp.dtype(dtype).name
  config = config_from_hf(json.loads(config_file.read_text()), dtype=dtype_name,
                          param_dtype=jnp.dtype(param_dtype).name if param_dtype else None,
                          source=str(config_file))
  params = load_params(model_dir, config, mesh)
  tokenizer = load_tokenizer(model_dir) if with_tokenizer else None
  return Pretrained(config, params, tokenizer, model_dir)


def param_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
