"""The loader refuses bad checkpoints with a message that names the file or tensor at fault."""

import json
import shutil

import huggingface_hub
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import eppo_jax
from pipeline_util import smoke_tiny_dir  # pylint: disable=unused-import

VICTIM = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def checkpoint(hf_checkpoints, tmp_path):
  """A private, writable copy of a sharded random Llama checkpoint."""
  _, source = hf_checkpoints("llama")
  return shutil.copytree(source, tmp_path / "model")


def _shard_of(model_dir, name):
  index = json.loads((model_dir / "model.safetensors.index.json").read_text())
  return model_dir / index["weight_map"][name]


def _rewrite_shard(path, edit):
  """Rewrites a safetensors file after `edit(dict_of_arrays)` has changed its tensors."""
  with safe_open(str(path), framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})


def test_intact_copy_loads(checkpoint):
  """Control: the copy the other tests damage loads fine before it is damaged."""
  pre = eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)
  assert pre.config.num_layers == 2


def test_missing_config_json(checkpoint):
  """No config.json: FileNotFoundError naming config.json."""
  (checkpoint / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match=r"config\.json"):
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)


def test_missing_tensor_is_named(checkpoint):
  """A tensor absent from its shard is reported by its HF name."""
  _rewrite_shard(_shard_of(checkpoint, VICTIM), lambda t: t.pop(VICTIM))
  with pytest.raises(ValueError, match="missing tensors") as err:
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)
  assert VICTIM in str(err.value)


def test_misshaped_tensor_is_named_with_both_shapes(checkpoint):
  """A tensor of the wrong shape is reported with its name, file shape and expected shape."""
  def edit(tensors):
    tensors[VICTIM] = np.zeros((47, 32), np.float32)
  _rewrite_shard(_shard_of(checkpoint, VICTIM), edit)
  with pytest.raises(ValueError, match="mis-shaped") as err:
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)
  assert f"{VICTIM}: file (47, 32) vs expected (48, 32)" in str(err.value)


def test_unexpected_tensor_is_named(checkpoint):
  """A tensor the architecture has no slot for (here an o_proj bias) is refused by name."""
  name = "model.layers.0.self_attn.o_proj.bias"
  _rewrite_shard(_shard_of(checkpoint, VICTIM), lambda t: t.update({name: np.ones(32, np.float32)}))
  with pytest.raises(ValueError, match="unexpected tensors") as err:
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)
  assert name in str(err.value)


def test_missing_shard_is_named(checkpoint):
  """A shard listed in the index but absent on disk is reported by its path."""
  shard = _shard_of(checkpoint, VICTIM)
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=shard.name):
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)


def test_no_weights_at_all(checkpoint):
  """A directory with a config but no safetensors says which files it looked for."""
  for f in checkpoint.glob("model*.safetensors*"):
    f.unlink()
  with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)


def test_unknown_architecture(checkpoint):
  """An unsupported architecture is refused, naming it, the config file and what is supported."""
  path = checkpoint / "config.json"
  cfg = json.loads(path.read_text())
  cfg["architectures"] = ["GPT2LMHeadModel"]
  path.write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)
  assert str(path) in str(err.value) and "LlamaForCausalLM" in str(err.value)


def test_unsupported_rope_scaling_is_named(checkpoint):
  """A RoPE scaling type the decoder does not implement is refused at load, naming type and file."""
  path = checkpoint / "config.json"
  cfg = json.loads(path.read_text())
  cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
  path.write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="yarn") as err:
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)
  assert str(path) in str(err.value)


def test_unsupported_activation_is_named(checkpoint):
  """A non-SiLU MLP would run silently wrong, so it is refused at load."""
  path = checkpoint / "config.json"
  cfg = json.loads(path.read_text())
  cfg["hidden_act"] = "gelu"
  path.write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="gelu"):
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)


def test_hub_id_not_in_cache(tmp_path, monkeypatch):
  """An 'org/name' id absent from an empty offline cache is named, with how to fetch it."""
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  with pytest.raises(FileNotFoundError, match="eppo-test/not-downloaded") as err:
    eppo_jax.load_pretrained("eppo-test/not-downloaded", with_tokenizer=False)
  assert "never downloads" in str(err.value)


def test_nonexistent_local_path(tmp_path):
  """A path that is neither a directory nor a hub id is named in the error."""
  missing = tmp_path / "nowhere" / "model"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    eppo_jax.load_pretrained(missing, with_tokenizer=False)


def test_file_instead_of_directory(checkpoint):
  """Passing config.json itself (a file) asks for the directory instead."""
  with pytest.raises(ValueError, match="model directory"):
    eppo_jax.load_pretrained(checkpoint / "config.json", with_tokenizer=False)


def test_truncated_shard_is_named(checkpoint):
  """A shard cut short (an interrupted download) is refused naming the file, not just
  "incomplete metadata"."""
  shard = _shard_of(checkpoint, VICTIM)
  data = shard.read_bytes()
  shard.write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"{shard}: unreadable safetensors file"):
    eppo_jax.load_pretrained(checkpoint, with_tokenizer=False)


def test_garbage_weights_file_is_named(smoke_tiny_dir, tmp_path):
  """A single model.safetensors that is not a safetensors file at all names the file."""
  model = shutil.copytree(smoke_tiny_dir, tmp_path / "model")
  (model / "model.safetensors").write_bytes(b"\xff" * 64 + b"not a safetensors file")
  with pytest.raises(ValueError, match=r"model\.safetensors: unreadable safetensors file"):
    eppo_jax.load_pretrained(model, with_tokenizer=False)
  data = (smoke_tiny_dir / "model.safetensors").read_bytes()
  (model / "model.safetensors").write_bytes(data[:len(data) - 100])  # Truncated tensor data.
  with pytest.raises(ValueError, match=r"model\.safetensors: unreadable safetensors file"):
    eppo_jax.load_pretrained(model, with_tokenizer=False)


def test_folder_without_tokenizer_is_refused(hf_checkpoints, smoke_tiny_dir, tmp_path):
  """A Qwen2 folder with weights but no tokenizer files is refused, naming the files it needs,
  instead of loading a tokenizer that encodes everything to nothing."""
  _, qwen2 = hf_checkpoints("qwen2_oldstyle")
  assert not list(qwen2.glob("tokenizer*")) and not (qwen2 / "vocab.json").exists()
  with pytest.raises(FileNotFoundError, match=r"no tokenizer files \(needs tokenizer\.json"):
    eppo_jax.load_pretrained(qwen2)
  # Control: the same check passes on a folder that has its tokenizer.
  tokenizer = eppo_jax.load_pretrained(smoke_tiny_dir).tokenizer
  assert tokenizer("hello world", add_special_tokens=False)["input_ids"]
