"""Hosts: start `jax.distributed`, move values between hosts and devices, agree across hosts,
and stop together.

`eppo_jax.mesh` says where arrays live (layout rules); this module moves them there and back and
holds every host-level agreement (gathers, maxima, barriers). On one process each function is a
plain device transfer or a no-op, so single-host code calls them unconditionally.

Failures: `jax.distributed`'s coordination service watches every process's heartbeats and ends
all of them when one stops beating (killed, crashed, frozen) for `heartbeat_timeout_s`. An
exception on one host would leave the others waiting in their next collective, so
`stop_together` turns it into the end of that process, which the service then sees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from eppo_jax.mesh import BATCH, batch_sharding, batch_shards

def launcher() -> str | None:
  """What says this process is one host of a multi-host job, or None: `JAX_COORDINATOR_ADDRESS`,
  else the cluster that `jax.distributed.initialize()` itself would detect (its cluster
  environments: a Cloud TPU VM pod from its metadata server, GKE TPU workers, Slurm, Open MPI,
  Kubernetes), in the order jax tries them."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  for cluster in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
    if not cluster.opt_in_only_method and cluster.is_env_present():
      return cluster.__name__
  return None


def initialize(cfg) -> None:
  """Starts `jax.distributed` per `cfg.distributed` ("auto" | "on" | "off"); idempotent.

  "auto" starts it when `cfg.coordinator_address` is set or a `launcher()` is found; jax then
  reads the coordinator, process count and index from that launcher.
  """
  mode = cfg.initialize
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed.initialize must be auto, on or off; got {mode!r}")
  explicit = bool(cfg.coordinator_address)
  found = launcher() if mode == "auto" and not explicit else None
  if mode == "off" or (mode == "auto" and not explicit and not found) or (
      jax.distributed.is_initialized()):
    return
  global _heartbeat_s
  _heartbeat_s = int(cfg.heartbeat_timeout_s)
  kwargs = dict(heartbeat_timeout_seconds=_heartbeat_s)
  if explicit:
    kwargs.update(coordinator_address=cfg.coordinator_address,
                  num_processes=cfg.num_processes, process_id=cfg.process_id)
  jax.distributed.initialize(**kwargs)
  logging.getLogger(__name__).info(
      "jax.distributed (%s): process %d of %d, %d local / %d global devices",
      found or "config.distributed", jax.process_index(), jax.process_count(),
      jax.local_device_count(), jax.device_count())


def put(tree, sharding_tree):
  """Places host values that every process holds in full (params, state) onto their shardings."""
  def place(x, sharding):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
      # Already in place (weights loaded straight into their shardings): the same buffers, now
      # labelled with `sharding` as a program's outputs will be, or a jitted step that gets them
      # back would be traced and compiled a second time (one-device meshes).
      return x if x.sharding == sharding else jax.device_put(x, sharding, may_alias=True)
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


def global_max(value):
  """The maximum over all hosts of a host-side integer, or of each entry of an integer vector
  (one collective either way; shapes must agree across hosts). Values must fit int32."""
  values = np.asarray(value, np.int64)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    values = np.asarray(multihost_utils.process_allgather(values.astype(np.int32))).max(axis=0)
  return int(values) if values.ndim == 0 else values.astype(np.int64)


def row_positions(rows: int, mesh: Mesh) -> np.ndarray:
  """The global batch index of each of this host's `rows` rows, where `put_rows` places them.

  `make_array_from_process_local_data` lays a host's rows over the batch slices its devices hold,
  in the slices' global order; a host's slices need not be contiguous on every mesh.
  """
  if jax.process_count() == 1:
    return np.arange(rows)
  total, shards = rows * jax.process_count(), batch_shards(mesh)
  slices = batch_sharding(mesh).addressable_devices_indices_map((total,)).values()
  starts = sorted({index[0].start or 0 for index in slices})
  return np.concatenate([np.arange(s, s + total // shards) for s in starts])


def barrier(name: str) -> None:
  """Waits until every host reaches this point (a no-op on one host)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------------
# Stopping together.

_FAILURES = "eppo_jax/failed/"  # Keys of the coordination service's store: host index -> cause.
_RAISED = "eppo_jax/raised/"  # The same for the `together` exceptions of `stop_together`.
_TOGETHER_S = 30.0  # How long a host waits for the others to raise a `together` exception too.
_ASK_TIMEOUT_S = 5.0  # How long a failing host asks the service about the others before exiting.
_heartbeat_s = 100  # jax.distributed's heartbeat timeout (`initialize` sets the configured one).


@contextlib.contextmanager
def stop_together(agreed: tuple[type[BaseException], ...] = (),
                  together: tuple[type[BaseException], ...] = ()):
  """Makes an exception on one host of a multi-host run end every host (a no-op on one process).

  The `agreed` exceptions (raised by every host at the same point by construction, such as a stop
  that the hosts agreed on) propagate. The `together` ones (usually raised by every host, such as
  a bad config, but not by construction) propagate if every host raises one within
  `_TOGETHER_S`, so each host reports it as what it is and the hosts exit together; otherwise
  they are treated as any other exception. Any other exception that leaves the block ends this
  process at once with status 1 instead of propagating: it is logged with its traceback, recorded in `jax.distributed`'s
  key-value store, and one line on stderr, `error: host I of N ...`, names the host and the
  cause. Nothing else runs on the way out (no `finally`, no `atexit`): a clean exit would wait in
  the service's shutdown barrier for hosts that wait in a collective for this one. With this
  process gone, the service ends the other hosts within `distributed.heartbeat_timeout_s`; a
  host whose own collective fails first (CPU collectives notice a dead peer at once) comes here
  too, and its line names the host that failed before it, or the host that is gone.
  """
  try:
    yield
  except agreed:
    raise
  except BaseException as error:  # pylint: disable=broad-exception-caught
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
      raise
    if isinstance(error, together) and _every_host_raised(error):
      raise
    _exit_failed(error)


def _every_host_raised(error: BaseException) -> bool:
  """Records in the coordination service that this host raised `error`; True once every host has
  recorded one (False after `_TOGETHER_S`, or if the service cannot be reached)."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    client = distributed.global_state.client
    client.key_value_set(f"{_RAISED}{jax.process_index()}", _cause(error), allow_overwrite=True)
    deadline = time.monotonic() + _TOGETHER_S
    while time.monotonic() < deadline:
      if len(client.key_value_dir_get(_RAISED)) >= jax.process_count():
        return True
      time.sleep(0.2)
  except Exception:  # pylint: disable=broad-exception-caught
    pass
  return False


def _cause(error: BaseException) -> str:
  """`Type: first line of the message`, at most 300 characters of it."""
  text = (str(error).strip().splitlines() or [""])[0][:300]
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _exit_failed(error: BaseException) -> None:
  """Logs and records `error`, prints the one line, and ends this process (status 1)."""
  host, count = jax.process_index(), jax.process_count()
  cause = _cause(error)
  logging.getLogger(__name__).error("host %d of %d failed", host, count, exc_info=error)
  found = []
  # The service may be gone with its host (process 0): ask from a thread, and not for long. Which
  # host vanished the service knows only once its heartbeats have stopped for the timeout.
  asking = threading.Thread(target=_ask_service, args=(host, count, cause, error, found),
                            daemon=True)
  asking.start()
  collective = isinstance(error, jax.errors.JaxRuntimeError)
  asking.join(_ASK_TIMEOUT_S + (_heartbeat_s if collective else 0))
  if found:
    line = f"error: host {host} of {count} stops: {found[0]} (here: {cause})"
  else:
    line = f"error: host {host} of {count} failed: {cause}; every host stops"
  sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access


def _ask_service(host: int, count: int, cause: str, error: BaseException, found: list) -> None:
  """Records this host's cause; appends what explains it better, if anything: another host's own
  failure (not a collective that failed because of a third host), else the hosts that the
  service no longer sees (for a failed collective), else the other hosts' failed collectives."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    client = distributed.global_state.client
    collective = isinstance(error, jax.errors.JaxRuntimeError)
    client.key_value_set(f"{_FAILURES}{host}", json.dumps([collective, cause]),
                         allow_overwrite=True)
    others = sorted((int(key.rsplit("/", 1)[-1]), json.loads(value))
                    for key, value in client.key_value_dir_get(_FAILURES))
    others = [(other, failed, text) for other, (failed, text) in others if other != host]
    first = [f"host {other} failed: {text}" for other, failed, text in others if not failed]
    if first:
      found.append("; ".join(first))
      return
    if collective:  # Did a peer vanish? The service knows once its heartbeats are overdue.
      gone = sorted(set(range(count)) - set(client.get_live_nodes(list(range(count)))))
      if gone:
        found.append(f"host {', '.join(map(str, gone))} is gone (killed or crashed, no error "
                     "recorded)")
        return
    if others:
      found.append("; ".join(f"host {other} failed: {text}" for other, _, text in others))
  except Exception:  # pylint: disable=broad-exception-caught
    pass  # The service is unreachable: the line names this host's own cause.
