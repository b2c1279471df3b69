"""The locally built tiny model is an ordinary HF directory: our loader, transformers and chat."""

import dataclasses
import json

import numpy as np
import pytest

import eppo_jax
from eppo_jax.models import tiny

from conftest import TOKENIZER_CORPUS, fast_logits, hf_logits, left_padded_batch, max_valid_diff

SPEC = eppo_jax.TinySpec(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=512, seed=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """A tiny model built once for this module."""
  return eppo_jax.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TOKENIZER_CORPUS,
                                   SPEC)


def test_loads_with_tokenizer_and_matches_spec(tiny_dir):
  """load_pretrained reads the directory: config from the spec, vocabulary from the tokenizer."""
  pre = eppo_jax.load_pretrained(tiny_dir)
  cfg = pre.config
  assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (32, 64, 2)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 8)
  assert cfg.tie_word_embeddings and cfg.architecture == "LlamaForCausalLM"
  assert cfg.vocab_size == len(pre.tokenizer)
  stamp = json.loads((tiny_dir / "eppo_jax_tiny.json").read_text())
  assert stamp["num_params"] == cfg.num_params()
  assert pre.tokenizer.eos_token == "<|im_end|>" and pre.tokenizer.pad_token == "<|pad|>"
  # Byte-level BPE: any text round-trips, and the action tags are single tokens.
  text = "Ünïcode & <action>left</action> 42"
  assert pre.tokenizer.decode(pre.tokenizer.encode(text)) == text
  for tag in tiny.EXTRA_TOKENS:
    assert len(pre.tokenizer.encode(tag)) == 1


def test_chat_template_renders_chatml(tiny_dir):
  """The saved tokenizer renders ChatML with the generation prompt."""
  pre = eppo_jax.load_pretrained(tiny_dir)
  messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+2?"}]
  text = pre.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert text == ("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                  "<|im_start|>assistant\n")
  ids = pre.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
  ids = ids["input_ids"] if hasattr(ids, "keys") else ids
  assert ids.count(pre.tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


def test_transformers_reads_it_with_the_same_logits(tiny_dir):
  """transformers loads the tiny directory, and its logits equal ours."""
  import transformers  # pylint: disable=g-import-not-at-top
  pre = eppo_jax.load_pretrained(tiny_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir),
                                                            attn_implementation="eager")
  tok = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
  assert tok.encode("Move the box") == pre.tokenizer.encode("Move the box")
  tokens, mask = left_padded_batch(pre.config.vocab_size, (24, 9), seed=1)
  ours = np.asarray(fast_logits(pre.params, pre.config, tokens, mask))
  assert max_valid_diff(hf_logits(model.float().eval(), tokens, mask), ours, mask) < 1e-4


def test_rebuild_reuses_or_rebuilds(tmp_path):
  """Same inputs reuse the directory untouched; a different spec or corpus rebuilds it."""
  out = tmp_path / "model"
  eppo_jax.build_tiny_model(out, TOKENIZER_CORPUS, SPEC)
  weights = out / "model.safetensors"
  first = weights.stat().st_mtime_ns
  first_bytes = weights.read_bytes()

  assert eppo_jax.build_tiny_model(out, TOKENIZER_CORPUS, SPEC) == out
  assert weights.stat().st_mtime_ns == first

  eppo_jax.build_tiny_model(out, TOKENIZER_CORPUS, dataclasses.replace(SPEC, seed=1))
  assert weights.stat().st_mtime_ns != first
  assert weights.read_bytes() != first_bytes  # New seed, new weights.
  second = weights.stat().st_mtime_ns

  eppo_jax.build_tiny_model(out, TOKENIZER_CORPUS[:-1], dataclasses.replace(SPEC, seed=1))
  assert weights.stat().st_mtime_ns != second


def test_interrupted_build_is_rebuilt(tmp_path):
  """Without the completion stamp (an interrupted build) the directory is rebuilt, not reused."""
  out = tmp_path / "model"
  eppo_jax.build_tiny_model(out, TOKENIZER_CORPUS, SPEC)
  (out / "eppo_jax_tiny.json").unlink()
  before = (out / "model.safetensors").stat().st_mtime_ns
  eppo_jax.build_tiny_model(out, TOKENIZER_CORPUS, SPEC)
  assert (out / "model.safetensors").stat().st_mtime_ns != before
  assert (out / "eppo_jax_tiny.json").exists()


def test_empty_corpus_is_refused(tmp_path):
  """A tokenizer cannot be trained on nothing: the error says so."""
  with pytest.raises(ValueError, match="corpus is empty"):
    eppo_jax.build_tiny_model(tmp_path / "m", [], SPEC)
