"""Peak host memory of `load_pretrained` on a ~500M-parameter bf16 checkpoint, relative to its size.

  python bench/load_memory.py                 # ~505M params, ~1.0 GB bf16 on disk, ~1-2 min
  python bench/load_memory.py --layers 4      # quick look (~170M params)
  python bench/load_memory.py --like-7b 8 --mesh-fsdp 16   # per-device peaks, 7B layout (~1 min)

Writes a random Llama checkpoint (bf16, sharded like the hub's) tensor by tensor with safetensors'
NumPy API, so writing it never holds more than one shard. Then runs two fresh subprocesses under
`/usr/bin/time -v` (or, without it, `getrusage(RUSAGE_CHILDREN)`):

  baseline: import jax and eppo_jax and start the CPU backend;
  load:     the same, then `load_pretrained(dir, dtype=jnp.bfloat16, with_tokenizer=False)`.

and prints the checkpoint size, both peak RSS values, (peak - baseline) / size and peak / size.
The goal is (peak - baseline) / size <= 1.5: the loader must not hold a second copy of the model.

`--mesh-fsdp N` loads onto a (data=1, fsdp=N, tensor=1) mesh of N virtual CPU devices, twice, each
in a fresh process: "unsharded" as before `load_pretrained(mesh=...)` existed (every leaf put on
the default device, then `mesh.put` onto its sharding) and "sharded" (`load_pretrained(...,
mesh=mesh)`). After every placement it sums `shard.data.nbytes` over `jax.live_arrays()` per
device (XLA:CPU has no `memory_stats`), and prints the peak device's bytes relative to model / N
and to the largest leaf's shard, with each run's peak host RSS (on CPU, device memory is host
memory, so RSS includes it). `--like-7b K` writes Qwen2.5-7B's layout (`fit.MODEL_SHAPES`: 28
layers, q/k/v bias, 28 heads / 4 kv heads, untied head) with hidden, intermediate, head and
vocabulary sizes divided by K, so every leaf is the same fraction 1/K^2 of its 7B counterpart.
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
from eppo_jax.models.hf import _tensor_map, config_from_hf, config_to_hf

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

# Per-device live bytes after every placement; argv: model dir, fsdp size, "sharded"/"unsharded".
MESH_CODE = """
import collections, json, sys, time
import jax, jax.numpy as jnp
import eppo_jax
from eppo_jax import hosts
from eppo_jax import mesh as meshlib
mesh = meshlib.make_mesh(meshlib.MeshConfig(1, int(sys.argv[2]), 1))
peak = collections.Counter()
largest = [0]

def sample():
  # By buffer: a global array and the single-device arrays it was assembled from share buffers.
  buffers = {}
  for x in jax.live_arrays():
    largest[0] = max(largest[0], x.nbytes)
    for shard in x.addressable_shards:
      buffers[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
  live = collections.Counter()
  for (device, _), nbytes in buffers.items():
    live[device] += nbytes
  for device, nbytes in live.items():
    peak[device] = max(peak[device], nbytes)

def sampled(fn):
  def call(*args, **kwargs):
    out = fn(*args, **kwargs)
    sample()
    return out
  return call

# Both are looked up on the module at call time by the loader and by `mesh.put`.
jax.device_put = sampled(jax.device_put)
jax.make_array_from_callback = sampled(jax.make_array_from_callback)
start = time.perf_counter()
if sys.argv[3] == "sharded":
  params = eppo_jax.load_pretrained(sys.argv[1], dtype=jnp.bfloat16, with_tokenizer=False,
                                    mesh=mesh).params
else:
  params = eppo_jax.load_pretrained(sys.argv[1], dtype=jnp.bfloat16, with_tokenizer=False).params
  params = hosts.put(params, meshlib.shardings(params, mesh))
jax.block_until_ready(params)
leaves = jax.tree_util.tree_leaves(params)
print("RESULT " + json.dumps({
    "seconds": time.perf_counter() - start, "model": sum(x.nbytes for x in leaves),
    "largest_leaf": largest[0], "devices": len(jax.devices()), "peak": dict(peak),
    "final": {d.id: sum(s.data.nbytes for x in leaves for s in x.addressable_shards
                        if s.device == d) for d in jax.devices()}}), flush=True)
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


def peak_rss_bytes(code: str, *args: str, devices: int = 1) -> tuple[int, str]:
  """Peak resident set size of `python -c code args` in a fresh process, and its stdout."""
  cmd = [sys.executable, "-c", code, *args]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
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


def like_7b(divisor: int, layers: int) -> ModelConfig:
  """Qwen2.5-7B's layout with every width divided by `divisor` (and `layers` layers)."""
  from eppo_jax.fit import MODEL_SHAPES  # pylint: disable=g-import-not-at-top
  shape = dict(MODEL_SHAPES["Qwen/Qwen2.5-7B-Instruct"])
  for key in ("vocab_size", "hidden_size", "intermediate_size"):
    if shape[key] % divisor:
      raise ValueError(f"--like-7b {divisor} does not divide {key}={shape[key]}")
    shape[key] //= divisor
  shape["num_hidden_layers"] = layers
  shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
  return config_from_hf(shape, dtype="bfloat16")


def report_mesh(root: Path, fsdp: int) -> None:
  """Peak per-device bytes of the unsharded-then-put load and of the sharded load."""
  baseline, _ = peak_rss_bytes(BASELINE_CODE, devices=fsdp)
  print(f"baseline peak host RSS (import jax + eppo_jax, {fsdp} devices): "
        f"{baseline / 2**30:.3f} GiB")
  for mode in ("unsharded", "sharded"):
    rss, out = peak_rss_bytes(MESH_CODE, str(root), str(fsdp), mode, devices=fsdp)
    r = json.loads(out.split("RESULT ", 1)[1])
    model, leaf = r["model"], r["largest_leaf"]
    top = max(r["peak"].values())
    ideal = model / fsdp
    print(f"{mode:>9}: peak device {top / 2**20:8.2f} MiB = {top / ideal:5.2f} x model/{fsdp}; "
          f"above model/{fsdp}: {(top - ideal) / (leaf / fsdp):6.2f} largest-leaf shards; "
          f"final max device {max(r['final'].values()) / 2**20:.2f} MiB; "
          f"peak host RSS {rss / 2**30:.3f} GiB; {r['seconds']:.1f} s")
  print(f"model {model / 2**20:.2f} MiB, largest leaf {leaf / 2**20:.2f} MiB "
        f"({leaf / model:.3f} of the model), model/{fsdp} = {ideal / 2**20:.2f} MiB")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=None, help="default 24 (28 with --like-7b)")
  parser.add_argument("--intermediate", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=50000)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int, default=16)
  parser.add_argument("--shard-mb", type=int, default=200, help="shard size on disk")
  parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
  parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
  parser.add_argument("--like-7b", type=int, default=0, metavar="K",
                      help="Qwen2.5-7B's layout, widths divided by K (ignores the size flags)")
  parser.add_argument("--mesh-fsdp", type=int, default=0, metavar="N",
                      help="report per-device peaks on a fsdp=N mesh of N CPU devices")
  args = parser.parse_args()

  if args.like_7b:
    config = like_7b(args.like_7b, args.layers or 28)
  else:
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_layers=args.layers or 24,
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
    if args.mesh_fsdp:
      report_mesh(root, args.mesh_fsdp)
      return
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
