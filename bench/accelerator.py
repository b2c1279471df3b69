"""Model FLOPs utilisation of the EPPO update and roofline fraction of decode, on one accelerator.

  python bench/accelerator.py       # GPU/TPU: 0.5B and 1.5B shapes, T = 1024-4096, bf16
  python bench/accelerator.py --models qwen2.5-1.5b --seqs 2048 --attention cudnn
  python bench/accelerator.py --models tiny --dtype float32 --tokens 512 --seqs 32,64 \
      --attention blockwise,dense --decode-batches 1,8 --prompt-len 32 --new-tokens 32  # CPU check

Weights are random (the shape is what costs time), so nothing is downloaded.

* Update: `steps.train_step` as the trainer compiles it (one device, donated state, EPPO objective,
  one PPO epoch of `--minibatches` minibatches) on a B x T batch of `--tokens` tokens (B = tokens /
  T), for each model, sequence length, attention kernel ("auto": the chip's, as the trainer picks
  it) and mode (full fine-tuning, LoRA). Its
  model FLOPs are the old-log-prob pass over every minibatch but the first (whose own pass is the
  old policy's) plus forward + backward (3 forwards for full fine-tuning; 2 for LoRA, whose
  backward needs no weight gradients of the base), counted by
  `ModelConfig.forward_flops_per_token`. MFU = model FLOPs / step time / peak.
* Decode: greedy `sampling.rollout` at several batch sizes. A decode step reads every weight (the
  untied embedding table aside) and the whole K/V cache (attention spans all slots), and does
  2 x params + attention FLOPs per row. Its roofline time is max(bytes / bandwidth, FLOPs / peak);
  roofline fraction = that time / measured step time.

Peaks come from a table of dense bf16 TFLOP/s and HBM bandwidth by `device_kind`, or from
`--peak-tflops` / `--peak-gbps`; the achievable peaks measured here (a large bf16 matmul and a large
copy) are printed next to them, and fractions are given against both.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import MODELS as CPU_MODELS
from decode import decode_weight_bytes, time_jax
from train_step import GROUP, make_batch, trainer_update

from eppo_jax import lora
from eppo_jax.models import attention
from eppo_jax.models.config import LoraConfig, ModelConfig
from eppo_jax.models.transformer import init_params

MODELS = {
    **CPU_MODELS,  # "tiny" (the default preset's shape) and "100m", for CPU checks.
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                         attention_bias=True, architecture="Qwen2ForCausalLM"),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         tie_word_embeddings=True, attention_bias=True,
                         architecture="Qwen2ForCausalLM"),
}

# (substring of device_kind, dense bf16 TFLOP/s, HBM GB/s): vendor datasheet figures.
PEAKS = [("H200", 989, 4800), ("H100", 989, 3350), ("A100", 312, 2039), ("L4", 121, 300),
         ("v6 lite", 918, 1640), ("v5 lite", 197, 819), ("v5p", 459, 2765), ("v4", 275, 1200)]


def datasheet_peaks(device) -> tuple[float | None, float | None]:
  for key, tflops, gbps in PEAKS:
    if key.lower() in device.device_kind.lower():
      return tflops * 1e12, gbps * 1e9
  return None, None


def measured_peaks(dtype) -> tuple[float, float]:
  """(FLOP/s of an n x n x n matmul, bytes/s of a copy with read + write counted), best of 5.

  Sized so that one call takes about a millisecond or more on a GPU/TPU, where the launch
  overhead of a smaller call would show up as a lower peak.
  """
  on_cpu = jax.default_backend() == "cpu"
  n, copy_bytes = (2048, 1 << 28) if on_cpu else (8192, 1 << 32)
  def best(fn, x):
    times = []
    for _ in range(6):  # The first call compiles.
      start = time.perf_counter()
      x = jax.block_until_ready(fn(x))
      times.append(time.perf_counter() - start)
    return min(times[1:])

  flops = 2 * n**3 / best(jax.jit(lambda x: (x @ x) / n), jnp.ones((n, n), dtype))  # Stays 1.
  # Donated: the output reuses the input's buffer, so no page is touched for the first time.
  bump = jax.jit(lambda x: x + 1, donate_argnums=0)
  bandwidth = 2 * copy_bytes / best(bump, jnp.ones((copy_bytes // 4,), jnp.float32))
  return flops, bandwidth


def time_update(params, config: ModelConfig, mode: str, batch: int, seq: int, args) -> dict:
  """Seconds to compile `steps.train_step`, its median seconds after one untimed step, its model
  FLOPs and the compiler's peak bytes for it (arguments + outputs - donated + temporaries)."""
  if mode == "lora":
    config, params = lora.add_lora(params, config, LoraConfig(rank=16, alpha=32.0),
                                   jax.random.PRNGKey(1))
  trainable, frozen = lora.partition(
      params, lora.trainable_mask(params, full_finetune=mode == "full"))
  step, state = trainer_update(config, trainable, frozen,
                               make_batch(batch, seq, config.vocab_size), args.minibatches)
  start = time.perf_counter()
  memory = step.compiled(state, jax.random.PRNGKey(0)).memory_analysis()
  compile_s = time.perf_counter() - start
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes) if memory else 0
  times = []
  for i in range(1 + args.steps):  # The first run also pays for allocating its buffers.
    start = time.perf_counter()
    state, metrics = step(state, jax.random.PRNGKey(i))
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  # The old-log-prob pass (all minibatches but the first), then forward + backward. The backward
  # costs 2 forwards with weight gradients (full) and 1 without (LoRA: input gradients only).
  m = args.minibatches
  forwards = (m - 1) / m + (3 if mode == "full" else 2)  # One PPO epoch.
  scored = seq - 1  # Teacher forcing scores tokens 1..T-1 from positions 0..T-2.
  flops = forwards * config.forward_flops_per_token(scored) * batch * scored
  return dict(mode=mode, batch=batch, seq=seq, attention=config.attention_impl,
              compile_s=compile_s,
              step_s=float(np.median(times[1:])), model_flops=flops, peak_gib=peak / 2**30)


def time_decode(params, config: ModelConfig, batch: int, args) -> dict:
  """Seconds per decode step of a greedy rollout, and that step's bytes and FLOPs."""
  prompt = np.random.default_rng(0).integers(10, config.vocab_size, (batch, args.prompt_len))
  compile_s, prefill_s, total_s = time_jax(params, config, jnp.asarray(prompt, jnp.int32),
                                           args.new_tokens)
  step_s = max(total_s - prefill_s, 1e-9) / max(args.new_tokens - 1, 1)
  slots = args.prompt_len + args.new_tokens
  cache_bytes = (2 * config.num_layers * batch * config.num_kv_heads * slots * config.head_dim
                 * config.compute_dtype.itemsize)
  return dict(batch=batch, compile_s=compile_s, step_s=step_s,
              bytes=decode_weight_bytes(params, config) + cache_bytes,
              flops=batch * config.forward_flops_per_token(slots))


def _list(kind):
  return lambda text: [kind(x) for x in text.split(",")]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b", type=_list(str))
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--tokens", type=int, default=16384, help="update: tokens per step")
  parser.add_argument("--seqs", default="1024,2048,4096", type=_list(int),
                      help="update: tokens per sequence (batch = tokens / seq)")
  parser.add_argument("--attention", default="auto,blockwise", type=_list(str),
                      help="update: kernels (models/attention.py; auto = the chip's)")
  parser.add_argument("--modes", default="full,lora", type=_list(str))
  parser.add_argument("--minibatches", type=int, default=2)
  parser.add_argument("--steps", type=int, default=3, help="timed updates after the first")
  parser.add_argument("--decode-batches", default="1,16,64,256", type=_list(int))
  parser.add_argument("--prompt-len", type=int, default=256)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--peak-tflops", type=float, help="override the datasheet peak")
  parser.add_argument("--peak-gbps", type=float, help="override the datasheet bandwidth")
  parser.add_argument("--json", default=os.environ.get("OUT", "") and
                      os.path.join(os.environ["OUT"], "accelerator.json"))
  args = parser.parse_args()
  for name in args.models:
    if name not in MODELS:
      parser.error(f"--models: {name!r} is not one of {sorted(MODELS)}")
  for seq in args.seqs:
    if seq < 2 or args.tokens % seq:
      parser.error(f"--seqs: {seq} must be >= 2 and divide --tokens={args.tokens}")
    if (args.tokens // seq) % (GROUP * args.minibatches):
      parser.error(f"--seqs: {seq} gives {args.tokens // seq} sequences per step, not a multiple "
                   f"of {GROUP} (a group) x {args.minibatches} (--minibatches)")
  for impl in args.attention:
    if impl != "auto" and impl not in attention.IMPLEMENTATIONS:
      parser.error(f"--attention: {impl!r} is not auto or one of {attention.IMPLEMENTATIONS}")

  device = jax.local_devices()[0]
  sheet_flops, sheet_bw = datasheet_peaks(device)
  peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else sheet_flops
  peak_bw = args.peak_gbps * 1e9 if args.peak_gbps else sheet_bw
  meas_flops, meas_bw = measured_peaks(jnp.dtype(args.dtype))
  print(f"jax {jax.__version__}, {device.platform} {device.device_kind!r}, {args.dtype}")
  sheet = (f"{peak_flops:.3g} FLOP/s, {peak_bw:.3g} B/s" if peak_flops and peak_bw else
           "unknown device (fractions use the measured peaks)")
  print(f"peak: datasheet {sheet}; measured (matmul, copy) {meas_flops:.3g} FLOP/s, "
        f"{meas_bw:.3g} B/s")
  peak_flops, peak_bw = peak_flops or meas_flops, peak_bw or meas_bw
  report = dict(device=device.device_kind, jax=jax.__version__, dtype=args.dtype,
                peak_flops=peak_flops, peak_bw=peak_bw, measured_flops=meas_flops,
                measured_bw=meas_bw, update=[], decode=[])

  print(f"\nupdate: {args.tokens} tokens per step, {args.minibatches} minibatches, 1 epoch; "
        f"peak GiB: the compiler's (arguments + outputs - donated + temporaries)")
  print(f"{'model':>14} {'B x T':>10} {'kernel':>9} {'mode':>5} | {'compile s':>9} {'step s':>7} "
        f"{'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'of meas.':>8} {'peak GiB':>8}")
  models = {}
  for name in args.models:
    config = ModelConfig(**MODELS[name], dtype=args.dtype, param_dtype=args.dtype,
                         max_position_embeddings=max(4096, *args.seqs,
                                                     args.prompt_len + args.new_tokens))
    params = init_params(config, jax.random.PRNGKey(0))  # Random: the shape is what costs time.
    models[name] = config, params
    for seq in args.seqs:
      kernels = dict.fromkeys(attention.resolve(a, device.platform, args.dtype)
                              for a in args.attention)  # "auto" may name a listed kernel.
      for impl in kernels:
        for mode in args.modes:
          row = time_update(params, config.replace(attention_impl=impl), mode,
                            args.tokens // seq, seq, args)
          achieved = row["model_flops"] / row["step_s"]
          row.update(model=name, mfu=achieved / peak_flops, mfu_measured=achieved / meas_flops)
          report["update"].append(row)
          print(f"{name:>14} {f'{args.tokens // seq} x {seq}':>10} {impl:>9} {mode:>5} | "
                f"{row['compile_s']:9.1f} {row['step_s']:7.3f} {args.tokens / row['step_s']:9.0f} "
                f"{achieved / 1e12:8.3f} {row['mfu']:6.1%} {row['mfu_measured']:8.1%} "
                f"{row['peak_gib']:8.2f}", flush=True)

  print(f"\ndecode: prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy")
  print(f"{'model':>14} {'batch':>5} | {'compile s':>9} {'ms/step':>8} {'tok/s':>9} "
        f"{'GB/step':>8} {'bound':>7} {'roofline':>8} {'of meas.':>8}")
  for name, (config, params) in models.items():
    for b in args.decode_batches:
      row = time_decode(params, config, b, args)
      bound_s = max(row["bytes"] / peak_bw, row["flops"] / peak_flops)
      bound_meas_s = max(row["bytes"] / meas_bw, row["flops"] / meas_flops)
      kind = "memory" if row["bytes"] / peak_bw >= row["flops"] / peak_flops else "compute"
      row.update(model=name, roofline=bound_s / row["step_s"],
                 roofline_measured=bound_meas_s / row["step_s"], bound=kind)
      report["decode"].append(row)
      print(f"{name:>14} {b:5d} | {row['compile_s']:9.1f} {row['step_s'] * 1e3:8.2f} "
            f"{b / row['step_s']:9.0f} {row['bytes'] / 1e9:8.3f} {kind:>7} "
            f"{row['roofline']:8.1%} {row['roofline_measured']:8.1%}", flush=True)

  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
  main()
