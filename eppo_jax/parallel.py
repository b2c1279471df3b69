"""Hosts and `jax.pmap` layouts: start `jax.distributed`, gather across hosts, synchronise.

The trainer runs `jax.jit` over a device mesh (`eppo_jax.mesh`). The pmap helpers below
(`shard`, `replicate`, ...) lay out `[local_devices, per_device, ...]` batches for code that runs
the pure functions per device under `jax.pmap(axis_name=AXIS)` (benchmarks, tests).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import logging

AXIS = "data"

# Variables that tell a multi-host launcher started this process (TPU pods set their own metadata,
# which `jax.distributed.initialize()` reads without arguments).
_LAUNCHER_VARS = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES",
                  "MEGASCALE_COORDINATOR_ADDRESS")


def initialize(cfg) -> None:
  """Starts `jax.distributed` per `cfg.distributed` ("auto" | "on" | "off"); idempotent."""
  mode = cfg.initialize
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed.initialize must be auto, on or off; got {mode!r}")
  explicit = bool(cfg.coordinator_address)
  wanted = mode == "on" or (mode == "auto" and (explicit or any(v in os.environ
                                                                  for v in _LAUNCHER_VARS)))
  if not wanted or jax.distributed.is_initialized():
    return
  kwargs = {}
  if explicit:
    kwargs = dict(coordinator_address=cfg.coordinator_address,
                  num_processes=cfg.num_processes, process_id=cfg.process_id)
  jax.distributed.initialize(**kwargs)
  logging.getLogger(__name__).info(
      "jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
      jax.process_count(), jax.local_device_count(), jax.device_count())


def host_share(global_count: int, what: str) -> int:
  """This host's share of a global count, which must split evenly over hosts and devices."""
  if global_count % jax.device_count():
    raise ValueError(f"{what}={global_count} is not divisible by the {jax.device_count()} devices")
  return global_count // jax.process_count()


def shard(tree):
  """Host arrays [N, ...] -> [local_devices, N / local_devices, ...]."""
  n = jax.local_device_count()

  def split(x):
    x = np.asarray(x)
    if x.shape[0] % n:
      raise ValueError(f"batch of {x.shape[0]} does not split over {n} local devices")
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])

  return jax.tree_util.tree_map(split, tree)


def unshard(tree):
  """[local_devices, per_device, ...] -> [N, ...] on the host."""
  return jax.tree_util.tree_map(lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), tree)


def replicate(tree):
  """One copy of every leaf on each local device, as a [local_devices, ...] array for pmap."""
  devices = jax.local_devices()
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), (AXIS,)),
                                        jax.sharding.PartitionSpec(AXIS))

  def copies(x):
    x = jnp.asarray(x)
    return jax.make_array_from_single_device_arrays(
        (len(devices),) + x.shape, sharding, [jax.device_put(x[None], d) for d in devices])

  return jax.tree_util.tree_map(copies, tree)


def unreplicate(tree):
  """The copy on the first local device (replicas are identical by construction)."""

  def first(x):
    if isinstance(x, jax.Array) and len(x.addressable_shards) > 1:
      return x.addressable_shards[0].data[0]  # No cross-device gather.
    return x[0]

  return jax.tree_util.tree_map(first, tree)


def gather_hosts(tree):
  """Concatenates each leaf's leading axis over hosts (a no-op on one host).

  Hosts may hold different numbers of rows (an uneven evaluation split) and different trailing
  sizes (episode widths); an all-gather needs one shape everywhere, so every leaf is zero-padded to
  the largest shape over hosts, gathered, and each host's padding rows are dropped again. Trailing
  axes stay padded with zeros (False, 0) to the widest host.
  """
  if jax.process_count() == 1:
    return tree
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  leaves = [np.asarray(x) for x in leaves]
  ndim = max([x.ndim for x in leaves] + [1])
  shapes_LxD = np.array([x.shape + (0,) * (ndim - x.ndim) for x in leaves], np.int64)
  shapes_PxLxD = np.asarray(multihost_utils.process_allgather(shapes_LxD))
  target_LxD = shapes_PxLxD.max(axis=0)
  padded = [np.pad(x, [(0, int(t) - s) for s, t in zip(x.shape, target_LxD[i])])
            for i, x in enumerate(leaves)]
  stacked = multihost_utils.process_allgather(padded)  # Each leaf [P, *target].
  rows_PxL = shapes_PxLxD[:, :, 0]
  out = [np.concatenate([np.asarray(g)[p, :rows_PxL[p, i]] for p in range(len(rows_PxL))])
         for i, g in enumerate(stacked)]
  return jax.tree_util.tree_unflatten(treedef, out)


def global_max(value: int) -> int:
  """The maximum of a host-side integer over all hosts (shapes must agree across hosts)."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(np.asarray(value))))


def barrier(name: str) -> None:
  """Waits until every host reaches this point (a no-op on one host)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)
