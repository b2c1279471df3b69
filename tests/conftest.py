"""Shared test setup: 4 virtual CPU devices, an offline hub, and tiny random HF checkpoints."""

import os
import tempfile

# Before anything imports jax: the data-parallel tests pmap over 4 host devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # Also silences transformers' bars.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# XLA's persistent cache for every run the tests start (in process and in subprocesses), so the
# trainer's default (~/.cache/eppo_jax/xla) stays untouched; identical programs load from here.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "eppo_jax_tests_xla"))

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
from pathlib import Path  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

import eppo_jax  # pylint: disable=g-import-not-at-top,wrong-import-position

# `eppo_jax.logits` compiled once per (config, shape): on a shared CPU that is several times faster
# than running it op by op, and it is how callers use it.
fast_logits = jax.jit(eppo_jax.logits, static_argnums=1)

# Small enough to compile in a second on a shared CPU; every feature of the three families is on.
TINY_DIMS = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                 max_position_embeddings=256)
# Llama 3 RoPE scaling whose three frequency bands (kept, blended, stretched) all occur at
# head_dim 16 and whose effect shows at positions beyond 32.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
TOKENIZER_CORPUS = [
    "You are in a small room. There is a box to the north and a goal to the east.",
    "Move the box onto the goal. Valid actions: up, down, left, right.",
    "<action>up</action> The box moved. <action>left</action> You reached the goal!",
    "Countdown: use 3 5 7 25 to reach 100. Answer: (25 - 5) * (7 - 3 + 1) = 100",
    "The frozen lake is slippery; avoid the holes and reach the gift.",
]


def randomize_(model, seed: int, std: float = 0.15):
  """Fills every parameter (biases and norm weights included) with seeded noise, in place.

  HF initialises biases to 0 and norms to 1; those values would let a wrong name mapping pass.
  """
  import torch  # pylint: disable=g-import-not-at-top
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
      if name.endswith("norm.weight"):
        noise = noise + 1.0
      elif "embed_tokens" in name or "lm_head" in name:
        noise = noise * 4  # Larger logits, so small mapping errors are not lost in rounding.
      p.copy_(noise.to(p.dtype))
  return model


def make_hf_model(arch: str, seed: int = 0, **overrides):
  """A randomised `transformers` model of family `arch` ("llama", "qwen2", "qwen3")."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                "qwen3": transformers.Qwen3Config}[arch]
  config = config_cls(**{**TINY_DIMS, **overrides})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  return randomize_(model.float().eval(), seed)


def save_hf_model(model, out_dir, max_shard_size="20KB") -> Path:
  """`save_pretrained` with small shards, so the index path of the loader is exercised."""
  out_dir = Path(out_dir)
  model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
  return out_dir


def rewrite_config_old_style(model_dir: Path) -> None:
  """Turns transformers-5 `rope_parameters` into the top-level `rope_theta`/`rope_scaling` keys.

  That is how hub files written by older transformers (e.g. Qwen2.5) look.
  """
  path = Path(model_dir) / "config.json"
  cfg = json.loads(path.read_text())
  rope = dict(cfg.pop("rope_parameters"))
  cfg["rope_theta"] = rope.pop("rope_theta")
  cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
  cfg["torch_dtype"] = cfg.pop("dtype", "float32")
  path.write_text(json.dumps(cfg, indent=2))


def left_padded_batch(vocab_size: int, lengths, seed: int = 0):
  """int32 tokens [B,T] and mask [B,T]; row i holds `lengths[i]` tokens after left padding."""
  rng = np.random.default_rng(seed)
  t = max(lengths)
  tokens = rng.integers(0, vocab_size, size=(len(lengths), t)).astype(np.int32)
  mask = np.zeros((len(lengths), t), np.int32)
  for i, n in enumerate(lengths):
    mask[i, t - n:] = 1
    tokens[i, :t - n] = 0  # Pad id; its embedding must not leak into valid positions.
  return tokens, mask


def hf_logits(model, tokens, mask) -> np.ndarray:
  """float32 logits of a `transformers` model, RoPE positions counting only valid tokens.

  HF numbers positions 0..T-1 regardless of the mask unless told otherwise; our `logits` counts
  valid tokens, which is what generation with left padding does. Pass the same positions to both.
  """
  import torch  # pylint: disable=g-import-not-at-top
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)),
                attention_mask=torch.from_numpy(np.asarray(mask, np.int64)),
                position_ids=torch.from_numpy(positions.astype(np.int64)))
  return out.logits.float().numpy()


def max_valid_diff(a, b, mask) -> float:
  """Max |a - b| over the valid (mask = 1) positions only."""
  valid = np.asarray(mask, bool)
  return float(np.max(np.abs(np.asarray(a)[valid] - np.asarray(b)[valid])))


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
  """One temporary directory shared by the whole session (checkpoints are built once)."""
  return tmp_path_factory.mktemp("eppo_session")


@pytest.fixture(scope="session")
def small_tokenizer():
  """A byte-level BPE tokenizer with the chat template, trained locally on a few sentences."""
  from eppo_jax.models.tiny import train_tokenizer  # pylint: disable=g-import-not-at-top
  return train_tokenizer(TOKENIZER_CORPUS, 300)


# name -> (family, config overrides, old-style config.json). Covers: untied and tied embeddings,
# llama3 RoPE scaling, Qwen2 q/k/v bias, Qwen3 q/k norm with head_dim != hidden / heads, and GQA.
HF_VARIANTS = {
    "llama": ("llama", dict(tie_word_embeddings=False), False),
    "llama3_tied": ("llama", dict(tie_word_embeddings=True, head_dim=16, num_attention_heads=2,
                                  num_key_value_heads=1,
                                  rope_scaling=dict(LLAMA3_SCALING)), False),  # HF mutates it.
    "qwen2_oldstyle": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000.0), True),
    "qwen3": ("qwen3", dict(head_dim=12, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=False), False),
}


@pytest.fixture(scope="session")
def hf_checkpoints(session_dir):
  """Builds (lazily, once per session) a sharded random checkpoint per variant.

  Returns a function `name -> (torch model, directory)`.
  """
  built = {}

  def get(name):
    if name not in built:
      family, overrides, old_style = HF_VARIANTS[name]
      model = make_hf_model(family, seed=len(built) + 1, **overrides)
      out = save_hf_model(model, session_dir / name)
      if old_style:
        rewrite_config_old_style(out)
      built[name] = (model, out)
    return built[name]

  return get
