"""The device mesh: named axes `data`, `fsdp`, `tensor`, and where every array lives on it.

One mechanism runs every setting, from 1 CPU to a pod slice: the train step, the SFT step and the
rollout turn are `jax.jit` programs written for the *global* batch, with `NamedSharding`s over a
`jax.sharding.Mesh` telling XLA where arrays live. A data-only mesh (`data=-1, fsdp=1, tensor=1`,
the default) is plain data parallelism; `fsdp` additionally splits the weights, adapters and
optimizer state (each device gathers a layer's weights just before using it); `tensor` splits
attention heads, the MLP width and the vocabulary (Megatron-style, XLA adds the reductions).

The pure functions (`task_entropy`, `update_pacing`, `pacing_bounds`, `grpo_advantages`,
`eppo_loss`) keep their `axis_name` argument. Under `jax.pmap` / `shard_map` each device sees its
shard and the function adds the `psum`s itself (`axis_name="data"`); under the jitted global-view
step they run with `axis_name=None` on the whole batch, exactly as on one device, and the SPMD
partitioner inserts the same collectives where the sharded batch needs them. So a 1-device run, a
data-parallel run and a sharded run execute one program and compute the same update.

Layout rules (Llama / Qwen, layers scanned so weights carry a leading [L] axis):
  embed_tokens/embedding [V,D]            vocab over tensor, hidden over fsdp
  q/k/v_proj, gate/up_proj, lm_head [..,D,X]  input over fsdp, output (heads / MLP / vocab) over tensor
  o_proj, down_proj [..,X,D]              input over tensor, output over fsdp
  bias [..,X]; lora_a [..,in,r]; lora_b [..,r,out]  follow their kernel's in / out axes
  norms, scalars, pacing state            replicated
A dimension the axis size does not divide stays unsharded on that axis (e.g. 4 kv heads on 8-way
tensor). Optimizer moments mirror their parameter (the rules match on the parameter path inside
the optimizer state). Batches split their leading axis over (`data`, `fsdp`); the KV cache
[L,B,K,S,H] splits B over (`data`, `fsdp`) and K over `tensor` where it divides.

Multi-host: every process builds the same mesh over all devices; `eppo_jax.hosts` places each
host's rows into the global batch and holds every agreement between hosts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # The mesh axes that split episodes.

# (input axis, output axis) of each projection's kernel [..., in, out].
_COLUMN = ("fsdp", "tensor")  # Hidden in, heads / MLP / vocab out.
_ROW = ("tensor", "fsdp")  # Heads / MLP in, hidden out.
_PROJECTIONS = {"q_proj": _COLUMN, "k_proj": _COLUMN, "v_proj": _COLUMN, "gate_proj": _COLUMN,
                "up_proj": _COLUMN, "lm_head": _COLUMN, "o_proj": _ROW, "down_proj": _ROW}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes, as in `config.mesh` (-1: the devices the other axes leave)."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1


DATA_ONLY = MeshConfig()


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with one -1 resolved to the remaining devices; checks the product."""
  sizes = [int(mesh_cfg.data), int(mesh_cfg.fsdp), int(mesh_cfg.tensor)]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"config.mesh sizes must be positive with at most one -1; got {sizes}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"config.mesh {sizes}: {num_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"config.mesh data x fsdp x tensor = {sizes} needs {math.prod(sizes)} "
                     f"devices; there are {num_devices}")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """The (data, fsdp, tensor) mesh over `devices` (default: every device of every host).

  Raises ValueError when a batch shard would span several processes (`host_split_shards`).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  try:  # Physical placement: `tensor` on the fastest links (innermost), `data` outermost.
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    grid = mesh_utils.create_device_mesh(shape, devices)
  except (AssertionError, ValueError, NotImplementedError):
    grid = np.asarray(devices).reshape(shape)
  if host_split_shards(grid):  # E.g. tensor 4 along a v5e 4x4 row, whose chips are on 2 hosts.
    grid = by_process(grid)
  if split := host_split_shards(grid):
    (data, fsdp), processes = split[0]
    raise ValueError(
        f"config.mesh tensor={shape[2]}: the batch shard (data {data}, fsdp {fsdp}) would span "
        f"processes {processes}, and a batch shard's rows come from one host; use a tensor size "
        f"that divides the {len(devices) // _process_count(grid)} devices of a process")
  return Mesh(grid, AXES)


def _process_count(grid: np.ndarray) -> int:
  return len({d.process_index for d in grid.flat})


def host_split_shards(grid: np.ndarray) -> list:
  """[((data, fsdp), processes)] of the batch shards of a [data, fsdp, tensor] device grid whose
  devices (the shard's tensor group) belong to several processes.

  A host places its own rows of the batch (`hosts.put_rows`), so every device that holds a batch
  shard must be one host's: a shard split over two hosts would get two hosts' different rows.
  """
  owners = np.vectorize(lambda d: d.process_index, otypes=[int])(grid)  # [data, fsdp, tensor]
  split = owners.min(-1) != owners.max(-1)
  return [(tuple(int(i) for i in index), sorted(set(owners[tuple(index)].tolist())))
          for index in np.argwhere(split)]


def by_process(grid: np.ndarray) -> np.ndarray:
  """The devices of `grid` in process-major order, reshaped to its shape: each process's devices
  consecutive (in their order in `grid`), so that a tensor group that divides a process's
  devices stays on that process."""
  flat = list(grid.flat)
  order = sorted(range(len(flat)), key=lambda i: (flat[i].process_index, i))
  return np.asarray([flat[i] for i in order], dtype=object).reshape(grid.shape)


def batch_shards(mesh: Mesh) -> int:
  """How many ways a batch is split (data x fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def _path_names(path) -> list[str]:
  """The dict keys and attribute names along a pytree path (indices dropped)."""
  names = []
  for key in path:
    name = getattr(key, "key", getattr(key, "name", None))
    if isinstance(name, str):
      names.append(name)
  return names


def _fit(spec: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh) -> P:
  """`spec` with every axis dropped whose size does not divide its dimension."""
  out = [a if a is not None and dim % mesh.shape[a] == 0 else None for a, dim in zip(spec, shape)]
  return P(*out)


def param_spec(path, shape: Sequence[int], mesh: Mesh) -> P:
  """The PartitionSpec of the leaf at `path` (params, adapters, optimizer state or anything)."""
  names = _path_names(path)
  ndim = len(shape)
  if ndim == 0 or not names:
    return P()
  leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
  spec = [None] * ndim
  if owner == "embed_tokens" and leaf == "embedding" and ndim >= 2:
    spec[-2:] = ["tensor", "fsdp"]
  elif owner in _PROJECTIONS:
    axis_in, axis_out = _PROJECTIONS[owner]
    if leaf == "kernel" and ndim >= 2:
      spec[-2:] = [axis_in, axis_out]
    elif leaf == "bias":
      spec[-1] = axis_out
    elif leaf == "lora_a" and ndim >= 2:
      spec[-2] = axis_in
    elif leaf == "lora_b" and ndim >= 2:
      spec[-1] = axis_out
  return _fit(spec, shape, mesh)


def shardings(tree, mesh: Mesh):
  """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) by the layout rules."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(path, np.shape(x), mesh)), tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (episode) axis over data x fsdp; a prefix that fits every batch leaf."""
  return NamedSharding(mesh, P(BATCH))


def minibatch_sharding(mesh: Mesh) -> NamedSharding:
  """A [minibatches, rows, ...] stack with its rows split like the batch (`StepConfig`)."""
  return NamedSharding(mesh, P(None, BATCH))


def cache_shardings(mesh: Mesh, num_kv_heads: int) -> dict:
  """Shardings of a `transformer.init_cache` dict: rows over data x fsdp, kv heads over tensor."""
  heads = "tensor" if num_kv_heads % mesh.shape["tensor"] == 0 else None
  return {"k": NamedSharding(mesh, P(None, BATCH, heads)),
          "v": NamedSharding(mesh, P(None, BATCH, heads)),
          "mask": NamedSharding(mesh, P(BATCH)), "index": replicated(mesh),
          "pos": NamedSharding(mesh, P(BATCH))}


def constrain_rows(x):
  """Pins the leading (row) axis of `x` to data x fsdp while tracing under `jax.set_mesh`.

  Activations pinned to their rows leave XLA one choice for a layer whose weights are split over
  `fsdp`: gather the weights (FSDP), rather than gather every device's rows. A no-op without an
  ambient mesh (one device, `pmap`) or when the rows do not divide.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH) <= set(mesh.axis_names):
    return x
  if x.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):
    return x
  return jax.lax.with_sharding_constraint(x, P(BATCH))
