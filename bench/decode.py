"""Decode throughput of `eppo_jax.rollout` vs. `transformers` `generate`, on the same weights.

  python bench/decode.py                       # tiny model, batch 1/16/64 (~4 min on 2 cores)
  python bench/decode.py --models tiny,100m    # + the ~134M Llama (~20 min on 2 cores, HF-bound)
  python bench/decode.py --batch-sizes 16 --new-tokens 32   # quick look

Both sides decode greedily, with no stop token, `--new-tokens` tokens after a `--prompt-len` prompt
(HF with `min_new_tokens = max_new_tokens`, so it never stops early). Throughput counts generated
tokens over the whole call, prefill included; compilation is reported apart (JAX compiles ahead
with `lower().compile()`; HF gets a short warm-up generate). PyTorch gets as many threads as the
cores JAX's CPU backend sees, so neither side has more.
The roofline column is the fraction of the measured copy bandwidth (large NumPy copy) that the
decode steps reach when each step reads every weight once: weight bytes x steps/s / bandwidth.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import eppo_jax
from eppo_jax import sampling
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.hf import param_bytes
from eppo_jax.models.tiny import TinySpec, build_tiny_model
from eppo_jax.models.transformer import init_params

# ~100M-class Llama: 85M in the layers + 2 x 25M untied embedding / head = 134M parameters.
LLAMA_100M = ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                         num_heads=12, num_kv_heads=12, head_dim=64, max_position_embeddings=2048)


def synthetic_corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
  """Word soup for the tokenizer of the tiny model (content is irrelevant to speed)."""
  rng = np.random.default_rng(seed)
  words = ["move", "left", "right", "up", "down", "box", "goal", "wall", "agent", "the", "a",
           "coin", "room", "north", "south", "east", "west", "take", "open", "door", "key"]
  return [" ".join(rng.choice(words, size=12)) + f" {i}" for i in range(n_lines)]


def copy_bandwidth(n_bytes: int = 1 << 29, repeats: int = 3) -> float:
  """Bytes/s of a large NumPy copy (read + write counted), best of `repeats`."""
  src = np.ones(n_bytes // 4, np.float32)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - start)
  return 2 * n_bytes / best


def decode_weight_bytes(params, config: ModelConfig) -> int:
  """Bytes of weights one decode step reads: all of them, except the untied embedding table."""
  total = param_bytes(params)
  if not config.tie_word_embeddings:  # Only B rows of the table are gathered.
    total -= config.vocab_size * config.hidden_size * config.weight_dtype.itemsize
  return total


def time_jax(params, config, prompt_BxP, new_tokens: int):
  """(compile seconds, prefill seconds, total seconds) of a greedy rollout, compiled ahead."""
  mask_BxP = jnp.ones(prompt_BxP.shape, bool)
  rng = jax.random.PRNGKey(0)
  timings = {}
  for n in (1, new_tokens):  # n = 1 isolates the prefill (+ one step).
    cfg = sampling.SamplingConfig(max_new_tokens=n, greedy=True)
    fn = jax.jit(lambda p, t, m, r, cfg=cfg: sampling.rollout(p, config, t, m, r, cfg))
    start = time.perf_counter()
    compiled = fn.lower(params, prompt_BxP, mask_BxP, rng).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(params, prompt_BxP, mask_BxP, rng))
    timings[n] = (compile_s, time.perf_counter() - start)
    assert int(out.lengths.min()) == n
  return timings[new_tokens][0], timings[1][1], timings[new_tokens][1]


def time_hf(model, prompt_BxP, new_tokens: int, pad_id: int):
  """(warm-up seconds, total seconds) of HF greedy generate."""
  import torch  # pylint: disable=g-import-not-at-top
  ids = torch.tensor(np.asarray(prompt_BxP), dtype=torch.long)
  kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=pad_id)
  with torch.inference_mode():
    start = time.perf_counter()
    model.generate(ids[:, :8], **{**kw, "attention_mask": torch.ones_like(ids[:, :8]),
                                  "max_new_tokens": 4, "min_new_tokens": 4})
    warm = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(ids, **kw)
    total = time.perf_counter() - start
  assert out.shape[1] == ids.shape[1] + new_tokens
  return warm, total


def bench_model(name, params, config, model_dir, args, bandwidth, threads):
  """Prints one table row per batch size."""
  weight_bytes = decode_weight_bytes(params, config)
  hf_model = None
  if not args.skip_hf:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(threads)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()
  print(f"\n{name}: {config.num_params() / 1e6:.1f}M params, {weight_bytes / 2**20:.0f} MiB read "
        f"per decode step, dtype {config.dtype}")
  print(f"{'batch':>5} | {'jax tok/s':>10} {'compile s':>9} {'prefill s':>9} {'roofline':>8} | "
        f"{'hf tok/s':>9} | {'ratio':>6}")
  rng = np.random.default_rng(0)
  for b in args.batch_sizes:
    prompt_BxP = jnp.asarray(rng.integers(10, config.vocab_size, (b, args.prompt_len)), jnp.int32)
    compile_s, prefill_s, total_s = time_jax(params, config, prompt_BxP, args.new_tokens)
    jax_tps = b * args.new_tokens / total_s
    step_s = max(total_s - prefill_s, 1e-9) / max(args.new_tokens - 1, 1)
    roofline = weight_bytes / step_s / bandwidth
    hf_cell, ratio_cell = f"{'-':>9}", f"{'-':>6}"
    if hf_model is not None:
      _, hf_s = time_hf(hf_model, prompt_BxP, args.new_tokens, pad_id=0)
      hf_tps = b * args.new_tokens / hf_s
      hf_cell, ratio_cell = f"{hf_tps:9.1f}", f"{jax_tps / hf_tps:5.2f}x"
    print(f"{b:5d} | {jax_tps:10.1f} {compile_s:9.1f} {prefill_s:9.2f} {roofline:8.1%} | "
          f"{hf_cell} | {ratio_cell}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="tiny", help="comma list of tiny, 100m")
  parser.add_argument("--batch-sizes", default="1,16,64",
                      type=lambda s: [int(x) for x in s.split(",")])
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--skip-hf", action="store_true", help="time only the JAX side")
  args = parser.parse_args()

  threads = len(os.sched_getaffinity(0))  # XLA's CPU backend uses every core it may run on.
  bandwidth = copy_bandwidth()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {threads} cores; torch threads = "
        f"{threads}; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s")
  print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, no stop")
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.models.split(","):
      model_dir = os.path.join(tmp, name)
      if name == "tiny":
        build_tiny_model(model_dir, synthetic_corpus(), TinySpec())
        pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
        params, config = pre.params, pre.config
      elif name == "100m":
        config = LLAMA_100M
        params = init_params(config, jax.random.PRNGKey(0))
        eppo_jax.export_hf(params, config, model_dir)
      else:
        raise ValueError(f"unknown model {name!r}")
      bench_model(name, params, config, model_dir, args, bandwidth, threads)


if __name__ == "__main__":
  main()
