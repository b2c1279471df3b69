"""Decode throughput of `eppo_jax.rollout` vs. `transformers` `generate`, on the same weights.

  python bench/decode.py --cores 1             # tiny model, batch 1/16/64, 3 interleaved repeats
  python bench/decode.py --models tiny,100m    # + the ~134M Llama (HF-bound on CPU)
  python bench/decode.py --batch-sizes 16 --new-tokens 32 --repeats 1   # quick look

Both sides decode greedily, with no stop token, `--new-tokens` tokens after a `--prompt-len` prompt
(HF with `min_new_tokens = max_new_tokens`, so it never stops early). Throughput counts generated
tokens over the whole call, prefill included; compilation is reported apart (JAX compiles ahead
with `lower().compile()` and runs the program once untimed; HF gets a short warm-up generate).
Each side runs in its own fresh process on the same cores (`--cores`); HF is timed with 1 thread
and with PyTorch's default threads, interleaved with ours and repeated `--repeats` times, and the
ratio uses the faster HF setting's median (see `common.py`).
The roofline column is the fraction of the measured copy bandwidth (large NumPy copy) that the
decode steps reach when each step reads every weight once: weight bytes x steps/s / bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import common

# ~100M-class Llama (ModelConfig kwargs): 85M in the layers + 2 x 25M untied embedding / head =
# 134M parameters.
LLAMA_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
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


def decode_weight_bytes(params, config) -> int:
  """Bytes of weights one decode step reads: all of them, except the untied embedding table."""
  from eppo_jax.models.hf import param_bytes  # pylint: disable=g-import-not-at-top
  total = param_bytes(params)
  if not config.tie_word_embeddings:  # Only B rows of the table are gathered.
    total -= config.vocab_size * config.hidden_size * config.weight_dtype.itemsize
  return total


def make_prompts(vocab_size: int, batch_sizes, prompt_len: int) -> dict[int, np.ndarray]:
  """batch size -> [B, P] random prompt ids; the same on both sides (fixed seed and order)."""
  rng = np.random.default_rng(0)
  return {b: rng.integers(10, vocab_size, (b, prompt_len)).astype(np.int32) for b in batch_sizes}


def time_jax(params, config, prompt_BxP, new_tokens: int):
  """(compile seconds, prefill seconds, total seconds) of a greedy rollout, compiled ahead and
  run once before it is timed."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from eppo_jax import sampling  # pylint: disable=g-import-not-at-top
  prompt_BxP = jnp.asarray(prompt_BxP)
  mask_BxP = jnp.ones(prompt_BxP.shape, bool)
  rng = jax.random.PRNGKey(0)
  timings = {}
  for n in (1, new_tokens):  # n = 1 isolates the prefill (+ one step).
    cfg = sampling.SamplingConfig(max_new_tokens=n, greedy=True)
    fn = jax.jit(lambda p, t, m, r, cfg=cfg: sampling.rollout(p, config, t, m, r, cfg))
    start = time.perf_counter()
    compiled = fn.lower(params, prompt_BxP, mask_BxP, rng).compile()
    compile_s = time.perf_counter() - start
    # One untimed call first, as HF gets its warm-up generate: a program's first run also pays
    # for allocating its buffers.
    jax.block_until_ready(compiled(params, prompt_BxP, mask_BxP, rng))
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


# ----------------------------------------------------------------------------------------------
# Workers (each in its own process): every batch size, one side.


def jax_worker(args) -> dict:
  """Our side: str(batch) -> {total_s, compile_s, prefill_s}, plus the weight bytes per step."""
  import jax  # pylint: disable=g-import-not-at-top
  import eppo_jax  # pylint: disable=g-import-not-at-top
  pre = eppo_jax.load_pretrained(args.model_dir, with_tokenizer=False)
  model = pre.config.replace(**common.tiny_model_options(pre.config))
  out = dict(platform=jax.devices()[0].platform, jax=jax.__version__,
             weight_bytes=decode_weight_bytes(pre.params, model),
             num_params=model.num_params(), dtype=str(model.dtype))
  prompts = make_prompts(model.vocab_size, args.batch_sizes, args.prompt_len)
  for b, prompt_BxP in prompts.items():
    compile_s, prefill_s, total_s = time_jax(pre.params, model, prompt_BxP, args.new_tokens)
    out[str(b)] = dict(total_s=total_s, compile_s=compile_s, prefill_s=prefill_s)
  return out


def hf_worker(args) -> dict:
  """HF's side at `--threads` (0 = PyTorch's default): str(batch) -> {total_s}."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  threads = common.set_torch_threads(args.threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      args.model_dir, dtype=torch.float32).eval()
  out = dict(threads=threads, torch=torch.__version__)
  prompts = make_prompts(model.config.vocab_size, args.batch_sizes, args.prompt_len)
  for b, prompt_BxP in prompts.items():
    _, total_s = time_hf(model, prompt_BxP, args.new_tokens, pad_id=0)
    out[str(b)] = dict(total_s=total_s)
  return out


# ----------------------------------------------------------------------------------------------
# Driver.


def build_model(name: str, model_dir: str) -> None:
  """Writes model `name` (tiny: the 3.3M `TinySpec()` model; 100m) as an HF directory."""
  import jax  # pylint: disable=g-import-not-at-top
  import eppo_jax  # pylint: disable=g-import-not-at-top
  from eppo_jax.models.tiny import TinySpec, build_tiny_model  # pylint: disable=g-import-not-at-top
  if os.path.isfile(os.path.join(name, "config.json")):  # A converted or downloaded model.
    shutil.copytree(name, model_dir)
  elif name == "tiny":
    build_tiny_model(model_dir, synthetic_corpus(), TinySpec())
  elif name == "100m":
    config = eppo_jax.ModelConfig(**LLAMA_100M)
    eppo_jax.export_hf(eppo_jax.init_params(config, jax.random.PRNGKey(0)), config, model_dir)
  else:
    raise SystemExit(f"unknown model {name!r} (tiny, 100m)")


def worker_argv(side: str, model_dir: str, args, threads: int = 0) -> list[str]:
  return ["--worker", side, "--model-dir", model_dir, "--threads", str(threads),
          "--batch-sizes", ",".join(map(str, args.batch_sizes)),
          "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]


def bench_model(name: str, model_dir: str, args, bandwidth: float, settings, default_threads):
  """Runs the interleaved workers for one model and prints one table row per batch size."""
  jobs = {"ours": lambda: common.run_worker(__file__, worker_argv("jax", model_dir, args))}
  jobs.update({n: (lambda n=n: common.run_worker(__file__, worker_argv("hf", model_dir, args, n)))
               for n in settings})
  runs = common.interleaved(jobs, args.repeats)
  ours = runs["ours"]
  info = ours[0]
  print(f"\n{name}: {info['num_params'] / 1e6:.1f}M params, {info['weight_bytes'] / 2**20:.0f} MiB "
        f"read per decode step, dtype {info['dtype']}")
  print(f"{'batch':>5} | {'jax tok/s':>10} {'compile s':>9} {'prefill s':>9} {'roofline':>8} | "
        f"{'hf tok/s @1':>11} {'@default':>9} | {'ratio':>6}  faster HF setting")
  for b in args.batch_sizes:
    mine = [r[str(b)] for r in ours]
    total_s, prefill_s = common.median(mine, "total_s"), common.median(mine, "prefill_s")
    jax_tps = b * args.new_tokens / total_s
    # Decode steps = the whole call less the prefill; too short a call leaves nothing to measure.
    step_s = (total_s - prefill_s) / max(args.new_tokens - 1, 1)
    roofline = (f"{info['weight_bytes'] / step_s / bandwidth:8.1%}"
                if args.new_tokens > 1 and step_s > 0 else f"{'-':>8}")
    row = (f"{b:5d} | {jax_tps:10.1f} {common.median(mine, 'compile_s'):9.1f} {prefill_s:9.2f} "
           f"{roofline} | ")
    if settings:
      hf_s = {n: common.median([r[str(b)] for r in runs[n]], "total_s") for n in settings}
      best = common.fastest(hf_s)
      cells = [f"{b * args.new_tokens / hf_s[n]:.1f}" if n in hf_s else "-" for n in (1, 0)]
      row += (f"{cells[0]:>11} {cells[1]:>9} | {hf_s[best] / total_s:5.2f}x  "
              f"{common.setting_name(best, default_threads)}")
    else:
      row += f"{'-':>11} {'-':>9} | {'-':>6}"
    print(row, flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cores", type=int, default=0,
                      help="cores for both sides (0 = all this process may use)")
  parser.add_argument("--models", default="tiny",
                      help="comma list of tiny, 100m or HF model directories "
                      "(models/smollm2-135m-instruct)")
  parser.add_argument("--batch-sizes", default="1,16,64",
                      type=lambda s: [int(x) for x in s.split(",")])
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3,
                      help="fresh processes per side and setting (medians are reported)")
  parser.add_argument("--skip-hf", action="store_true", help="time only the JAX side")
  # Internal: run one side in this process and print a RESULT line.
  parser.add_argument("--worker", choices=("jax", "hf"), help=argparse.SUPPRESS)
  parser.add_argument("--model-dir", help=argparse.SUPPRESS)
  parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    common.emit((jax_worker if args.worker == "jax" else hf_worker)(args))
    return

  cores = common.use_cores(args.cores)  # Before jax is imported; the workers inherit the mask.
  default_threads = common.torch_default_threads()
  settings = [] if args.skip_hf else common.peer_thread_settings(default_threads)
  bandwidth = copy_bandwidth()
  print(f"{cores} cores for both sides; HF at "
        f"{' and '.join(common.setting_name(n, default_threads) for n in settings) or '-'}; "
        f"measured copy bandwidth {bandwidth / 1e9:.1f} GB/s; medians of {args.repeats} "
        f"interleaved runs per side")
  print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, no stop")
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.models.split(","):
      model_dir = os.path.join(tmp, name)
      build_model(name, model_dir)
      bench_model(name, model_dir, args, bandwidth, settings, default_threads)


if __name__ == "__main__":
  main()
