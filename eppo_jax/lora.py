"""LoRA as a pytree transform: add adapter leaves, strip them, merge them, and mask the optimizer.

An adapted projection computes `x @ W + (x @ A) @ B * alpha / rank` (`models.transformer.Linear`),
applied only when the `lora_a`/`lora_b` leaves are present. So `base_params(params)` *is* the
reference policy for the KL term, at no extra memory.
"""

from __future__ import annotations

import dataclasses

import flax.traverse_util as tu
import jax
import jax.numpy as jnp
import numpy as np
import optax

from eppo_jax.models.config import LoraConfig, ModelConfig

_LORA_LEAVES = ("lora_a", "lora_b")


def is_lora_path(path: tuple[str, ...]) -> bool:
  return path[-1] in _LORA_LEAVES


def add_lora(params, config: ModelConfig, lora: LoraConfig, rng: jax.Array):
  """(config with `lora`, params with adapters): A ~ N(0, 1/fan_in), B = 0, so a no-op at start."""
  flat = tu.flatten_dict(params)
  kernels = sorted(p for p in flat if p[-1] == "kernel" and p[-2] in lora.targets)
  if not kernels:
    raise ValueError(f"no projection named in {lora.targets} found in the params")
  for i, path in enumerate(kernels):
    kernel = flat[path]
    *lead, fan_in, fan_out = kernel.shape  # Scanned layers add a leading [L] axis.
    key = jax.random.fold_in(rng, i)
    flat[path[:-1] + ("lora_a",)] = (jax.random.normal(key, (*lead, fan_in, lora.rank), jnp.float32)
                                     / jnp.sqrt(fan_in))
    flat[path[:-1] + ("lora_b",)] = jnp.zeros((*lead, lora.rank, fan_out), jnp.float32)
  return dataclasses.replace(config, lora=lora), tu.unflatten_dict(flat)


def base_params(params):
  """The frozen base model: every adapter leaf removed (the adapters-off reference policy)."""
  flat = tu.flatten_dict(params)
  return tu.unflatten_dict({p: v for p, v in flat.items() if not is_lora_path(p)})


def trainable_mask(params, full_finetune: bool = False):
  """Bool pytree: True where the optimizer may update (adapter leaves, or all leaves)."""
  flat = tu.flatten_dict(params)
  return tu.unflatten_dict({p: full_finetune or is_lora_path(p) for p in flat})


def partition(params, mask):
  """Splits params into (trainable, frozen) trees so gradients are taken only for the first."""
  flat, flat_mask = tu.flatten_dict(params), tu.flatten_dict(mask)
  trainable = {p: v for p, v in flat.items() if flat_mask[p]}
  frozen = {p: v for p, v in flat.items() if not flat_mask[p]}
  return tu.unflatten_dict(trainable), tu.unflatten_dict(frozen)


def combine(trainable, frozen):
  """Inverse of `partition`."""
  flat = tu.flatten_dict(frozen)
  flat.update(tu.flatten_dict(trainable))
  return tu.unflatten_dict(flat)


def masked_optimizer(tx: optax.GradientTransformation, mask) -> optax.GradientTransformation:
  """`tx` on masked leaves; the rest get zero updates and no optimizer state.

  `optax.multi_transform` with `set_to_zero` rather than `optax.masked`: the latter passes the raw
  gradient through as the update of unmasked leaves, which would move the frozen base.
  """
  labels = jax.tree_util.tree_map(lambda m: "train" if m else "freeze", mask)
  return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)


def merge_kernel(kernel, lora_a, lora_b, scale: float):
  """W + (A @ B) * scale, summed in float32 and cast back to W's dtype; NumPy or JAX arrays.

  The one merge formula: `merge` applies it on devices, `models.hf.export_hf` per tensor on the
  host. [..., in, out] kernels with [..., in, r] and [..., r, out] adapters (leading axes batch).
  """
  xp = jnp if any(isinstance(x, jax.Array) for x in (kernel, lora_a, lora_b)) else np
  delta = xp.matmul(lora_a.astype(np.float32), lora_b.astype(np.float32)) * np.float32(scale)
  return (kernel.astype(np.float32) + delta).astype(kernel.dtype)


def merge(params, config: ModelConfig):
  """Folds every adapter into its kernel (W + A @ B * scale) and drops the adapter leaves."""
  flat = tu.flatten_dict(params)
  scale = config.lora.scale if config.lora is not None else 0.0
  merged = {}
  for path, value in flat.items():
    if is_lora_path(path):
      continue
    if path[-1] == "kernel" and path[:-1] + ("lora_a",) in flat:
      value = merge_kernel(value, flat[path[:-1] + ("lora_a",)], flat[path[:-1] + ("lora_b",)],
                           scale)
    merged[path] = value
  return tu.unflatten_dict(merged)


def count(params) -> tuple[int, int]:
  """(adapter parameters, all parameters)."""
  flat = tu.flatten_dict(params)
  total = sum(v.size for v in flat.values())
  return sum(v.size for p, v in flat.items() if is_lora_path(p)), total
