"""Decisions a pod's hosts take, checked in one process: when `jax.distributed` starts, which
meshes a pod accepts. (The multi-process runs are in test_pod.py.)"""

import importlib.util
import types

import ml_collections
import numpy as np
import pytest
from jax._src.clusters import cloud_tpu_cluster

from eppo_jax import config_check, hosts
from eppo_jax import mesh as meshlib
from pipeline_util import smoke_config

_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                 "SLURM_PROCID", "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES",
                 "TPU_PROCESS_ADDRESSES", "KUBERNETES_SERVICE_HOST", "TPU_SKIP_MDS_QUERY")


@pytest.fixture
def bare(monkeypatch):
  """No launcher variable, not on a Cloud TPU VM; `jax.distributed.initialize` recorded."""
  for var in _CLUSTER_VARS:
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", False)
  calls = []
  monkeypatch.setattr(hosts.jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(hosts.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(hosts.jax, "process_index", lambda: 0)
  return calls


def _distributed(initialize="auto", address=""):
  return ml_collections.ConfigDict(dict(initialize=initialize, coordinator_address=address,
                                        num_processes=2, process_id=1, heartbeat_timeout_s=7))


def test_auto_stays_off_on_a_plain_machine(bare):
  assert hosts.launcher() is None
  hosts.initialize(_distributed())
  assert not bare


def test_auto_finds_a_tpu_vm_pod_from_its_metadata_alone(bare, monkeypatch):
  """`gcloud compute tpus tpu-vm ssh --worker=all` sets no variable: jax finds the pod from the
  metadata server, and so must "auto"."""
  monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
  monkeypatch.setattr(cloud_tpu_cluster, "get_metadata",
                      lambda key: ("3", cloud_tpu_cluster.metadata_response_code_success))
  assert hosts.launcher() == "GceTpuCluster"
  hosts.initialize(_distributed())
  assert bare == [dict(heartbeat_timeout_seconds=7)]  # jax reads the rest from the metadata.


@pytest.mark.parametrize("env, found", [
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, "JAX_COORDINATOR_ADDRESS"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
      "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}, "SlurmCluster"),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4"}, "OmpiCluster"),
])
def test_auto_finds_each_launcher(bare, monkeypatch, env, found):
  for var, value in env.items():
    monkeypatch.setenv(var, value)
  assert hosts.launcher() == found
  hosts.initialize(_distributed())
  assert len(bare) == 1


def test_an_interactive_slurm_shell_is_not_a_job(bare, monkeypatch):
  """`salloc` sets SLURM_NTASKS without a task of its own: jax would not start there either."""
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert hosts.launcher() is None


def test_explicit_address_and_off(bare):
  hosts.initialize(_distributed(address="127.0.0.1:5"))
  assert bare == [dict(heartbeat_timeout_seconds=7, coordinator_address="127.0.0.1:5",
                       num_processes=2, process_id=1)]
  hosts.initialize(_distributed("off", address="127.0.0.1:5"))
  assert len(bare) == 1
  with pytest.raises(ValueError, match="auto, on or off"):
    hosts.initialize(_distributed("maybe"))


def test_too_few_demonstrations_for_the_hosts_is_refused_up_front(monkeypatch):
  """8 hosts, 1 task x 4 demonstrations: four hosts would have none (and their SFT nothing to
  learn from), so the run is refused before anything loads, naming the field."""
  monkeypatch.setattr(config_check.jax, "process_count", lambda: 8)
  monkeypatch.setattr(config_check.jax, "device_count", lambda: 8)
  config = smoke_config("", **{"sft.demos_per_task": 4, "rollout.instances_per_step": 8,
                               "tasks.specs": ("frozenlake:easy",)})
  with pytest.raises(config_check.ConfigError, match="sft.demos_per_task x tasks = 4 .* 8 hosts"):
    config_check.validate(config)
  config.sft.demos_per_task = 8
  config_check.validate(config)


class _Device(types.SimpleNamespace):
  """A stand-in device: an id and the process that owns it."""


def _grid(owners) -> np.ndarray:
  """Devices laid out like `owners` [data, fsdp, tensor] (each entry: the owning process)."""
  owners = np.asarray(owners)
  flat = [_Device(id=i, process_index=int(p)) for i, p in enumerate(owners.flat)]
  return np.asarray(flat, dtype=object).reshape(owners.shape)


def test_a_batch_shard_split_over_hosts_is_found_and_rearranged():
  """2 hosts x 2 devices, data 2 x tensor 2, each tensor pair across both hosts (as a physical
  placement may put them): both shards are split; laid out by process, each host holds one."""
  grid = _grid([[[0, 1]], [[0, 1]]])
  assert meshlib.host_split_shards(grid) == [((0, 0), [0, 1]), ((1, 0), [0, 1])]
  fixed = meshlib.by_process(grid)
  assert meshlib.host_split_shards(fixed) == []
  assert [[d.process_index for d in row.flat] for row in fixed] == [[0, 0], [1, 1]]
  assert [d.id for d in fixed.flat] == [0, 2, 1, 3]  # Each host's devices keep their order.


def test_a_tensor_size_no_host_can_hold_is_refused(monkeypatch):
  """3 hosts x 4 devices, tensor 3: every layout splits a tensor group over two hosts."""
  devices = [_Device(id=i, process_index=i // 4, device_kind="cpu", platform="cpu")
             for i in range(12)]
  with pytest.raises(ValueError, match=r"tensor=3: the batch shard \(data 1, fsdp 0\) would span "
                     r"processes \[0, 1\].*divides the 4 devices of a process"):
    meshlib.make_mesh(meshlib.MeshConfig(data=-1, tensor=3), devices)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu for the topology: pip install -e '.[fit]'")
def test_v5e_4x4_fsdp_4_tensor_4_puts_each_batch_shard_on_one_host():
  """On a v5e 4x4 (4 hosts of 2x2 chips) jax's physical placement runs tensor 4 along a row of
  the torus, over 2 hosts; the mesh takes each host's 4 chips as one tensor group instead."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  devices = list(topologies.get_topology_desc("v5e:4x4", "tpu").devices)
  mesh = meshlib.make_mesh(meshlib.MeshConfig(data=1, fsdp=4, tensor=4), devices)
  assert meshlib.host_split_shards(mesh.devices) == []


def test_put_in_place_labels_the_arrays_so_a_donating_step_compiles_once():
  """Arrays already on a one-device mesh's device keep their buffers but take the mesh's sharding:
  a step that gets its own outputs back (state donated, shardings fixed) is traced once, not again
  at its second call."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY, jax.devices()[:1])
  sharding = {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())}
  state = hosts.put({"w": jnp.ones(3)}, sharding)
  step = jax.jit(lambda s: {"w": s["w"] * 2}, out_shardings=sharding, donate_argnums=0)
  with jax.set_mesh(mesh):
    for _ in range(3):
      state = step(state)
  np.testing.assert_array_equal(np.asarray(state["w"]), 8.0)
  assert step._cache_size() == 1  # pylint: disable=protected-access
