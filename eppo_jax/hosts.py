"""Hosts: start `jax.distributed`, move values between hosts and devices, agree across hosts.

`eppo_jax.mesh` says where arrays live (layout rules); this module moves them there and back and
holds every host-level agreement (gathers, maxima, barriers). On one process each function is a
plain device transfer or a no-op, so single-host code calls them unconditionally.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from eppo_jax.mesh import BATCH, batch_sharding, batch_shards

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


def put(tree, sharding_tree):
  """Places host values that every process holds in full (params, state) onto their shardings."""
  def place(x, sharding):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
      return x  # Already in place (weights loaded straight into their shardings).
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree_util.tree_map(place, tree, sharding_tree)


def put_rows(tree, mesh: Mesh):
  """This host's rows [n, ...] of a batch -> global arrays split over data x fsdp."""
  sharding = batch_sharding(mesh)
  local = batch_shards(mesh) // jax.process_count()

  def place(x):
    x = np.asarray(x)
    if x.shape[0] % max(local, 1):
      raise ValueError(f"{x.shape[0]} rows on this host do not split over its {local} batch shards")
    return jax.make_array_from_process_local_data(sharding, x)
  return jax.tree_util.tree_map(place, tree)


def local_rows(tree, mesh: Mesh):
  """Global batch arrays -> this host's rows as NumPy (the inverse of `put_rows`)."""
  if jax.process_count() == 1:
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  local = multihost_utils.global_array_to_host_local_array(tree, mesh, P(BATCH))
  return jax.tree_util.tree_map(np.asarray, local)


def fetch(tree):
  """Global arrays -> full NumPy values on every host (gathers sharded leaves across hosts)."""
  def get(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree_util.tree_map(get, tree)


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
