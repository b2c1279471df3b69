"""Builds the embedded default model: a local BPE tokenizer and a small random Llama, in HF format.

Nothing is downloaded: the tokenizer is trained on text the caller passes (the environments' prompts
and observations), the weights are random, and the result is an ordinary HF directory that
`load_pretrained` (and `transformers`) read like any hub checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterable

import jax

from eppo_jax.models import hf
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import init_params

# ChatML, the format of Qwen's instruct models, so prompts look the same for tiny and real models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
# Whole tokens for the action tags, so the small model emits the format in two steps, not ten.
EXTRA_TOKENS = ("<action>", "</action>")


@dataclasses.dataclass(frozen=True)
class TinySpec:
  """Size of the embedded model (a few million parameters by default)."""

  vocab_size: int = 2048
  hidden_size: int = 256
  intermediate_size: int = 768
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  max_position_embeddings: int = 4096
  seed: int = 0


def train_tokenizer(corpus: Iterable[str], vocab_size: int):
  """Byte-level BPE (every string is encodable) wrapped as a transformers fast tokenizer."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus, trainer=trainer)
  tok.add_tokens(list(EXTRA_TOKENS))
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|pad|>", bos_token=None, unk_token=None)
  fast.chat_template = CHAT_TEMPLATE
  return fast


STAMP = "eppo_jax_tiny.json"  # The build's fingerprint, written last.


def build_tiny_model(out_dir, corpus: Iterable[str], spec: TinySpec = TinySpec()) -> Path:
  """Writes the tokenizer, config and random weights to `out_dir`; reuses it if already built."""
  corpus = list(corpus)
  out_dir = Path(out_dir)
  fingerprint = hashlib.sha256(json.dumps([dataclasses.asdict(spec), corpus]).encode()).hexdigest()
  stamp = out_dir / STAMP
  if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
    return out_dir
  if not corpus:
    raise ValueError("the tokenizer corpus is empty")
  tokenizer = train_tokenizer(corpus, spec.vocab_size)
  config = ModelConfig(
      vocab_size=len(tokenizer),
      hidden_size=spec.hidden_size,
      intermediate_size=spec.intermediate_size,
      num_layers=spec.num_layers,
      num_heads=spec.num_heads,
      num_kv_heads=spec.num_kv_heads,
      head_dim=spec.hidden_size // spec.num_heads,
      rms_norm_eps=1e-6,
      rope_theta=10000.0,
      tie_word_embeddings=True,
      max_position_embeddings=spec.max_position_embeddings,
  )
  params = init_params(config, jax.random.PRNGKey(spec.seed))
  hf.export_hf(params, config, out_dir, tokenizer)
  # Written last, so an interrupted build is rebuilt rather than half-reused.
  stamp.write_text(json.dumps({"fingerprint": fingerprint, "spec": dataclasses.asdict(spec),
                               "num_params": config.num_params()}))
  return out_dir
