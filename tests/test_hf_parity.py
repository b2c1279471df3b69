"""The Flax decoder and the safetensors loader reproduce HF PyTorch Llama / Qwen2 / Qwen3 logits."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eppo_jax
from eppo_jax.models import hf
from eppo_jax.models.transformer import rope_frequencies

from conftest import (HF_VARIANTS, LLAMA3_SCALING, fast_logits, hf_logits, left_padded_batch,
                      max_valid_diff)

# Long rows so that positions reach 63 (beyond llama3's original 32), one row padded, one empty-ish.
LENGTHS = (64, 41, 7)


@pytest.mark.parametrize("name", sorted(HF_VARIANTS))
def test_logits_match_transformers_on_left_padded_batch(hf_checkpoints, name):
  """float32 logits equal HF's within 1e-4 at every valid position of a left-padded batch."""
  model, model_dir = hf_checkpoints(name)
  assert (model_dir / "model.safetensors.index.json").exists(), "checkpoint should be sharded"
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  tokens, mask = left_padded_batch(pre.config.vocab_size, LENGTHS, seed=7)
  ours = np.asarray(fast_logits(pre.params, pre.config, jnp.asarray(tokens), jnp.asarray(mask)))
  theirs = hf_logits(model, tokens, mask)
  assert ours.dtype == np.float32 and ours.shape == theirs.shape
  assert np.std(theirs[mask.astype(bool)]) > 0.5, "logits too flat to detect a wrong mapping"
  assert max_valid_diff(ours, theirs, mask) < 1e-4


def test_config_features_are_read(hf_checkpoints):
  """Each variant's config turns on the feature it is meant to test (tie, bias, q/k norm, GQA)."""
  cfgs = {n: eppo_jax.load_pretrained(hf_checkpoints(n)[1], with_tokenizer=False).config
          for n in HF_VARIANTS}
  assert cfgs["llama"].architecture == "LlamaForCausalLM" and not cfgs["llama"].tie_word_embeddings
  assert cfgs["llama3_tied"].tie_word_embeddings
  assert cfgs["llama3_tied"].rope_scaling_dict == LLAMA3_SCALING
  assert cfgs["llama3_tied"].num_heads == 2 and cfgs["llama3_tied"].num_kv_heads == 1
  assert cfgs["qwen2_oldstyle"].attention_bias and cfgs["qwen2_oldstyle"].rope_theta == 1000.0
  assert cfgs["qwen2_oldstyle"].head_dim == 8  # No head_dim key: hidden / heads.
  assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 12 and cfgs["qwen3"].num_kv_heads == 2
  for name, cfg in cfgs.items():
    params = eppo_jax.load_pretrained(hf_checkpoints(name)[1], with_tokenizer=False).params
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert n == cfg.num_params() == hf_checkpoints(name)[0].num_parameters(), name


def test_llama3_rope_frequencies_match_transformers(hf_checkpoints):
  """The llama3-scaled inverse frequencies equal HF's buffer, and differ from the unscaled ones."""
  model, model_dir = hf_checkpoints("llama3_tied")
  config = eppo_jax.load_pretrained(model_dir, with_tokenizer=False).config
  theirs = model.model.rotary_emb.inv_freq.numpy()
  ours = np.asarray(rope_frequencies(config))
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  unscaled = np.asarray(rope_frequencies(config.replace(rope_scaling=None)))
  assert ours[0] == unscaled[0]  # Short wavelength: kept.
  assert np.all(ours[2:] < unscaled[2:] / 7.99)  # Long wavelengths: stretched by the factor.
  assert unscaled[1] / 8 < ours[1] < unscaled[1]  # The band between: interpolated.


def test_llama3_scaling_changes_long_positions(hf_checkpoints):
  """The parity check above is sensitive to the scaling: ignoring it moves the logits."""
  _, model_dir = hf_checkpoints("llama3_tied")
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  tokens, mask = left_padded_batch(pre.config.vocab_size, LENGTHS, seed=7)
  scaled = fast_logits(pre.params, pre.config, tokens, mask)
  plain = fast_logits(pre.params, pre.config.replace(rope_scaling=None), tokens, mask)
  assert max_valid_diff(scaled, plain, mask) > 1e-2


def test_padding_does_not_change_valid_logits(hf_checkpoints):
  """A row's logits are the same alone and unpadded as inside a left-padded batch."""
  _, model_dir = hf_checkpoints("qwen3")
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  tokens, mask = left_padded_batch(pre.config.vocab_size, LENGTHS, seed=3)
  batch = np.asarray(fast_logits(pre.params, pre.config, tokens, mask))
  n = LENGTHS[1]
  alone = np.asarray(fast_logits(pre.params, pre.config, tokens[1:2, -n:], mask[1:2, -n:]))
  np.testing.assert_allclose(batch[1, -n:], alone[0], atol=1e-5)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_theta/rope_scaling"])
def test_config_from_hf_reads_both_rope_forms(style):
  """transformers-5 `rope_parameters` and the older top-level keys give the same ModelConfig."""
  base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "tie_word_embeddings": True}
  if style == "rope_parameters":
    base["rope_parameters"] = {**LLAMA3_SCALING, "rope_theta": 500000.0}
  else:
    base["rope_theta"] = 500000.0
    base["rope_scaling"] = dict(LLAMA3_SCALING)
  cfg = hf.config_from_hf(base)
  assert cfg.rope_theta == 500000.0
  assert cfg.rope_scaling_dict == LLAMA3_SCALING
  assert cfg.head_dim == 4 and cfg.num_kv_heads == 1 and cfg.tie_word_embeddings


def test_config_from_hf_default_rope_has_no_scaling():
  """A `default` rope type (transformers 5 always writes one) means no scaling, theta kept."""
  cfg = hf.config_from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10,
                           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "head_dim": 6,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
  assert cfg.rope_scaling is None and cfg.rope_theta == 1e6
  assert cfg.qk_norm and not cfg.attention_bias and cfg.num_kv_heads == 2 and cfg.head_dim == 6


def test_bf16_params_load_and_run_close_to_fp32(hf_checkpoints):
  """dtype=bfloat16 stores bf16 weights; its logits are finite and near the float32 ones."""
  _, model_dir = hf_checkpoints("qwen2_oldstyle")
  pre32 = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  pre16 = eppo_jax.load_pretrained(model_dir, dtype=jnp.bfloat16, with_tokenizer=False)
  dtypes = {x.dtype for x in jax.tree_util.tree_leaves(pre16.params)}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  tokens, mask = left_padded_batch(pre32.config.vocab_size, (24, 13), seed=5)
  l32 = np.asarray(fast_logits(pre32.params, pre32.config, tokens, mask))
  l16 = np.asarray(fast_logits(pre16.params, pre16.config, tokens, mask))
  assert l16.dtype == np.float32 and np.all(np.isfinite(l16))
  scale = np.std(l32[mask.astype(bool)])
  assert max_valid_diff(l16, l32, mask) < 0.1 * scale
  # Weights-only bf16 (float32 activations) lands between the two.
  mixed = eppo_jax.load_pretrained(model_dir, param_dtype=jnp.bfloat16, with_tokenizer=False)
  assert mixed.config.dtype == "float32" and mixed.config.param_dtype == "bfloat16"
  lmix = np.asarray(fast_logits(mixed.params, mixed.config, tokens, mask))
  assert max_valid_diff(lmix, l32, mask) < 0.1 * scale


def test_bf16_checkpoint_loads_exactly(hf_checkpoints, tmp_path):
  """A bf16 safetensors checkpoint loads bit-exactly as bf16 and upcasts exactly to float32."""
  import torch  # pylint: disable=g-import-not-at-top
  model, _ = hf_checkpoints("llama")
  model16 = type(model)(copy.deepcopy(model.config)).to(torch.bfloat16)
  model16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
  model16.save_pretrained(str(tmp_path), max_shard_size="20KB")
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  as16 = eppo_jax.load_pretrained(tmp_path, dtype=jnp.bfloat16, with_tokenizer=False).params
  as32 = eppo_jax.load_pretrained(tmp_path, with_tokenizer=False).params
  want = model16.model.layers[1].mlp.down_proj.weight.detach().float().numpy().T
  got16 = as16["params"]["layers"]["mlp"]["down_proj"]["kernel"][1]
  got32 = as32["params"]["layers"]["mlp"]["down_proj"]["kernel"][1]
  assert got16.dtype == jnp.bfloat16 and got32.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got16, np.float32), want)
  np.testing.assert_array_equal(np.asarray(got32), want)


def test_hub_id_resolves_from_local_cache_only(hf_checkpoints, tmp_path, monkeypatch):
  """An 'org/name' hub id is found in the HF cache offline, and loads like the directory."""
  import shutil  # pylint: disable=g-import-not-at-top
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  _, model_dir = hf_checkpoints("qwen3")
  cache = tmp_path / "hub"
  commit = "0123456789abcdef0123456789abcdef01234567"
  repo = cache / "models--eppo-test--tiny-qwen3"
  shutil.copytree(model_dir, repo / "snapshots" / commit)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
  pre = eppo_jax.load_pretrained("eppo-test/tiny-qwen3", with_tokenizer=False)
  assert pre.path == repo / "snapshots" / commit
  ref = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  jax.tree_util.tree_map(np.testing.assert_array_equal, pre.params, ref.params)


def test_loader_hands_leaves_to_cpu_without_a_copy():
  """The loader's aligned host buffers are adopted by `jax.device_put` on CPU (no second copy)."""
  if jax.default_backend() != "cpu":
    pytest.skip("zero-copy adoption is a CPU-backend property")
  buffer = hf._aligned_empty((3, 1000, 7), jnp.bfloat16)
  assert buffer.ctypes.data % 64 == 0 and buffer.shape == (3, 1000, 7)
  buffer[...] = 1.5
  leaf = jax.device_put(buffer)
  assert leaf.unsafe_buffer_pointer() == buffer.ctypes.data
  np.testing.assert_array_equal(np.asarray(leaf, np.float32), 1.5)
