"""Peak host memory of `load_pretrained` on a ~500M-parameter bf16 checkpoint, relative to its size.

  python bench/load_memory.py                 # ~505M params, ~1.0 GB bf16 on disk, ~1-2 min
  python bench/load_memory.py --layers 4      # quick look (~170M params)

Writes a random Llama checkpoint (bf16, sharded like the hub's) tensor by tensor with safetensors'
NumPy API, so writing it never holds more than one shard. Then runs two fresh subprocesses under
`/usr/bin/time -v` (or, without it, `getrusage(RUSAGE_CHILDREN)`):

  baseline: import jax and eppo_jax and start the CPU backend;
  load:     the same, then `load_pretrained(dir, dtype=jnp.bfloat16, with_tokenizer=False)`.

and prints the checkpoint size, both peak RSS values, (peak - baseline) / size and peak / size.
The goal is (peak - baseline) / size <= 1.5: the loader must not hold a second copy of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from eppo_jax.models.config import ModelConfig
from eppo_jax.models.hf import _tensor_map, config_to_hf

GOAL = 1.5

BASELINE_CODE = """
import jax, jax.numpy as jnp
import eppo_jax
jax.devices()
"""

LOAD_CODE = """
import sys, time
import jax, jax.numpy as jnp
import eppo_jax
jax.devices()
start = time.perf_counter()
pre = eppo_jax.load_pretrained(sys.argv[1], dtype=jnp.bfloat16, with_tokenizer=False)
jax.block_until_ready(pre.params)
n = sum(x.size for x in jax.tree_util.tree_leaves(pre.params))
assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(pre.params))
print(f"LOADED params={n} seconds={time.perf_counter() - start:.1f}", flush=True)
"""


def write_checkpoint(config: ModelConfig, out_dir: Path, shard_bytes: int, seed: int = 0) -> int:
  """Random bf16 weights in HF layout, one shard in memory at a time; returns bytes written."""
  rng = np.random.default_rng(seed)
  shard: dict[str, np.ndarray] = {}
  weight_map: dict[str, str] = {}
  total = 0
  files: list[str] = []

  def flush():
    name = f"model-{len(files) + 1:05d}.safetensors"  # Renamed to -of-N once N is known.
    save_file(shard, str(out_dir / name), metadata={"format": "pt"})
    files.append(name)
    weight_map.update({k: name for k in shard})
    shard.clear()

  size = 0
  for name, slot in _tensor_map(config).items():
    if name.endswith("norm.weight"):
      value = (1.0 + 0.02 * rng.standard_normal(slot.hf_shape, np.float32))
    else:
      value = 0.02 * rng.standard_normal(slot.hf_shape, np.float32)
    value = value.astype(ml_dtypes.bfloat16)
    if size and size + value.nbytes > shard_bytes:
      flush()
      size = 0
    shard[name] = value
    size += value.nbytes
    total += value.nbytes
  flush()
  renamed = {}
  for i, name in enumerate(files):
    final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    (out_dir / name).rename(out_dir / final)
    renamed[name] = final
  index = {"metadata": {"total_size": total},
           "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
  (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  (out_dir / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
  return total


def peak_rss_bytes(code: str, *args: str) -> tuple[int, str]:
  """Peak resident set size of `python -c code args` in a fresh process, and its stdout."""
  cmd = [sys.executable, "-c", code, *args]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  time_bin = shutil.which("time")  # GNU time (Debian package `time`), not the shell keyword.
  if time_bin:
    proc = subprocess.run([time_bin, "-v", *cmd], capture_output=True, text=True, env=env)
    if proc.returncode:
      raise RuntimeError(f"subprocess failed:\n{proc.stdout}\n{proc.stderr}")
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if match:
      return int(match.group(1)) * 1024, proc.stdout
  # Fallback: RUSAGE_CHILDREN keeps the maximum over all waited-for children, so run this one
  # first in a fresh helper process of its own.
  helper = ("import resource, subprocess, sys\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stderr.write(p.stderr); print(p.stdout, end='')\n"
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "sys.exit(p.returncode)")
  proc = subprocess.run([sys.executable, "-c", helper, *cmd], capture_output=True, text=True,
                        env=env)
  if proc.returncode:
    raise RuntimeError(f"subprocess failed:\n{proc.stdout}\n{proc.stderr}")
  kb = int(re.search(r"MAXRSS (\d+)", proc.stdout).group(1))
  return kb * 1024, proc.stdout


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--intermediate", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=50000)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int, default=16)
  parser.add_argument("--shard-mb", type=int, default=200, help="shard size on disk")
  parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
  parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
  args = parser.parse_args()

  config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.hidden // args.heads, tie_word_embeddings=False,
                       param_dtype="bfloat16", dtype="bfloat16")
  root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="eppo_load_memory_"))
  root.mkdir(parents=True, exist_ok=True)
  try:
    start = time.perf_counter()
    disk = write_checkpoint(config, root, args.shard_mb << 20)
    on_disk = sum(p.stat().st_size for p in root.glob("*.safetensors"))
    print(f"checkpoint: {config.num_params() / 1e6:.1f}M params, bf16, "
          f"{len(list(root.glob('*.safetensors')))} shards, {on_disk / 2**30:.3f} GiB on disk "
          f"({disk / 2**30:.3f} GiB of tensors), written in {time.perf_counter() - start:.0f} s")
    baseline, _ = peak_rss_bytes(BASELINE_CODE)
    peak, out = peak_rss_bytes(LOAD_CODE, str(root))
    print(out.strip())
    print(f"baseline peak RSS (import jax + eppo_jax): {baseline / 2**30:.3f} GiB")
    print(f"load peak RSS:                              {peak / 2**30:.3f} GiB")
    ratio = (peak - baseline) / on_disk
    print(f"(peak - baseline) / disk = {ratio:.2f}   peak / disk = {peak / on_disk:.2f}   "
          f"goal (peak - baseline) / disk <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}")
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
