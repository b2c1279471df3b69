"""A small pod on this machine (bench/pod.py): 2 processes x 2 CPU devices of one jax.distributed
job running the real trainer on the smoke preset, the batch and the weights split (fsdp) over all
4 devices of both processes, with the `paced` task: episodes of 1 + seed % 4 turns, so the hosts'
episodes end after different numbers of turns.

The runs share one workdir and follow each other (a module fixture): SIGTERM to one host, a
resumed run to the end, then kill -9 of one host in a further resumed run.
"""

import shutil
import signal
import sys
import textwrap

import jax
import numpy as np
import pytest

from eppo_jax import hosts
from eppo_jax.envs.sampler import TaskSampler
from eppo_jax.models import hf
from pipeline_util import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import pod  # pylint: disable=g-import-not-at-top,wrong-import-position

HEARTBEAT_S = 5  # distributed.heartbeat_timeout_s of these runs.
# The options run: GiGPO, dynamic sampling, the sampler's log-probs; 8 rollout rows per host (4
# instances x 2), so that the batch shrinks once few episodes play on; 3 evaluation instances,
# which the hosts split 2 and 1; the HF export. (Not the tensor axis: its programs hang in the CPU
# collectives of 2 processes x 2 devices now and then, docs/scaling.md.)
OPTIONS = {"advantage_estimator": "gigpo",
           "per_task_std": False, "rollout.dynamic_sampling": True,
           "rollout.extra_rounds": 1, "optim.old_logprobs": "sampler",
           "rollout.instances_per_step": 8,
           "train.eval_instances_per_task": 3, "train.export_hf": True, "train.num_steps": 2,
           # A warm start whose replies differ, so rewards that differ: a gradient (20 steps at
           # the full rate; the cosine decay left every group's rewards equal).
           "sft.steps": 20, "sft.schedule": "constant"}
STOP_BOUND_S = 60  # The most a host may take to stop after another host died.


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  directory = tmp_path_factory.mktemp("pod") / "tiny_model"
  pod.build_tiny_model(directory)
  return directory


def _export_diff(workdir, overrides) -> float:
  """The largest difference between the HF export and the trained weights of the checkpoint."""
  exported = hf.load_pretrained(workdir / "hf_export").params
  flat = {jax.tree_util.keystr(p): np.asarray(x, np.float64)
          for p, x in jax.tree_util.tree_flatten_with_path(exported)[0]}
  trained = pod.trained_params(workdir, overrides)
  assert set(flat) == set(trained), (sorted(flat)[:5], sorted(trained)[:5])
  return max(float(np.abs(flat[k] - trained[k]).max()) for k in flat)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
  """{name: (pod, result)} of the runs, in order, on one workdir."""
  base = tmp_path_factory.mktemp("pod_runs")
  workdir = base / "run"
  overrides = {"model.tiny_dir": str(tiny), "mesh.data": 1, "mesh.fsdp": 4,
               "train.eval_instances_per_task": 4, "train.eval_every": 0, "sft.steps": 1,
               "distributed.heartbeat_timeout_s": HEARTBEAT_S}

  def make(name, steps, fail="", **more):
    return pod.Pod(2, 2, workdir, base / name, {**overrides, "train.num_steps": steps, **more},
                   fail)

  out = {}
  # Host 1's envs raise at the third step of every third seed: its episodes end as failed there.
  term = make("term", 3, fail="1:step")
  out["term"] = term, pod.inject(term, 1, signal.SIGTERM, 600, after=1)
  out["term"][1]["checkpoints"] = pod.checkpoint_steps(workdir)
  # Resumed on a data 2 x fsdp 2 mesh (the checkpoint was written on fsdp 4).
  finish = make("finish", 3, fail="1:step", **{"mesh.data": 2, "mesh.fsdp": 2})
  out["finish"] = finish, pod.agree(finish, 600)
  kill = make("kill", 5)
  out["kill"] = kill, pod.inject(kill, 0, signal.SIGKILL, 600, after=3)
  # Every reset raises on host 1, so its SFT has no demonstration: a RuntimeError there only.
  fail = make("raise", 1, fail="1:reset")
  fail.workdir = base / "raise_run"
  out["raise"] = fail, pod.failing(fail, 600)
  # Options that change the programs, on their own workdir; then its copy resumed on 1 process.
  opts = {**overrides, **OPTIONS}
  options = pod.Pod(2, 2, base / "options_run", base / "options", opts)
  out["options"] = options, pod.agree(options, 600)
  out["options"][1]["export_diff"] = _export_diff(options.workdir, opts)
  shutil.copytree(options.workdir, base / "options_run_1")
  single = pod.Pod(1, 4, base / "options_run_1", base / "options_1",
                   {**opts, "train.num_steps": 3})
  out["options_1"] = single, pod.agree(single, 600)
  for name, (_, result) in out.items():
    print(name, result["seconds"], "s")
  return out


def test_sigterm_to_one_host_saves_the_same_step_on_both(runs):
  """SIGTERM to host 1 during RL step 2: both hosts stop at the same phase boundary (a turn of
  play, after play or after the update), save the last completed step, exit 128 + 15."""
  term, result = runs["term"]
  assert result["codes"] == [143, 143], result
  saved = result["last_step"][0]
  assert saved in (1, 2) and result["last_step"] == [saved, saved] and result["identical"], result
  assert all(f"stopped after RL step {saved} of 3" in m for m in result["messages"]), result
  assert result["checkpoints"][-1] == saved, result


def test_both_hosts_finish_with_identical_records(runs):
  """The resumed run, on a data x fsdp mesh: both exit 0; every record each host logged is the
  same, and the evaluation's numbers need both hosts' episodes (host 0 plays 1 and 3 turns, host
  1 2 and 4)."""
  finish, result = runs["finish"]
  assert result["codes"] == [0, 0], [finish.log(i)[-3000:] for i in range(2)]
  saved = runs["term"][1]["checkpoints"][-1]
  assert result["identical"] and result["steps"] == list(range(saved + 1, 4)), result
  assert "resumed from" in finish.log(0) and f"at RL step {saved}" in finish.log(0)
  outs = [finish.out(i) for i in range(2)]
  assert outs[0]["record"] == outs[1]["record"] == result["final"]
  assert outs[0]["processes"] == 2 and outs[0]["devices"] == 4
  final = result["final"]
  assert final["task/paced:easy/eval_turns"] == pytest.approx(2.5)
  # Host 1's second evaluation seed (2 rounds, a multiple of 3) fails at its second step.
  assert final["eval_env_failures"] == 1


def test_kill_of_host_0_stops_the_other_with_a_reason(runs):
  """kill -9 of host 0 (which holds the coordination service) during an RL step: host 1 exits
  non-zero within the bound, saying why."""
  kill, result = runs["kill"]
  assert result["codes"][0] == -signal.SIGKILL and result["codes"][1] not in (0, None), result
  assert result["seconds_after"][1] <= STOP_BOUND_S, result
  line = result["lines"][1]  # Ours, or jax's when the service went first.
  assert ("host 0" in line or "JAX distributed service detected fatal errors" in line
          and "leader task was preempted/died" in kill.log(1)), kill.log(1)[-3000:]


def test_options_that_change_the_programs_agree_over_hosts(runs):
  """The options run: both hosts exit 0 with identical records; the evaluation counts both
  hosts' episodes once each (host 1 plays one of the 3, next to a pad row); the batch shrank
  inside the trainer on both hosts; the export host 0 wrote holds the trained weights, gathered
  from both hosts' fsdp shards."""
  options, result = runs["options"]
  assert result["codes"] == [0, 0], [options.log(i)[-3000:] for i in range(2)]
  assert result["identical"] and result["steps"][-2:] == [1, 2], result
  final = result["final"]
  seeds = [seed for _, seed in TaskSampler(["paced:easy"], seed=0).eval_instances(3)]
  assert final["task/paced:easy/eval_turns"] == pytest.approx(np.mean([1 + s % 4 for s in seeds]))
  assert final["dynamic_sampling/rounds"] >= 1
  assert any(r.get("grad_norm", 0) > 0 for r in options.records(0)), options.records(0)
  assert all(options.out(i)["compactions"] for i in range(2)), [options.out(i) for i in range(2)]
  assert result["export_diff"] == 0.0


def test_a_pod_run_resumes_on_one_process(runs):
  """The options run's workdir, resumed on 1 process x 4 devices for one more step."""
  single, result = runs["options_1"]
  assert result["codes"] == [0], single.log(0)[-3000:]
  assert result["steps"] == [3] and "at RL step 2" in single.log(0)


def test_an_exception_on_one_host_stops_both_naming_it(runs):
  """Host 1 raises (no demonstration left): it exits 1 with its cause; host 0, whose next
  collective fails, exits 1 too, naming host 1 and that cause."""
  fail, result = runs["raise"]
  assert result["codes"] == [1, 1], result
  assert result["seconds_after_first_exit"] <= STOP_BOUND_S, result
  cause = "RuntimeError: every expert demonstration failed"
  assert result["lines"][1].startswith(f"host 1: error: host 1 of 2 failed: {cause}"), result
  assert f"error: host 0 of 2 stops: host 1 failed: {cause}" in result["lines"][0], result
  assert "injected: every reset fails on host 1" in fail.log(1)


def test_stop_together_on_one_process_lets_the_exception_through():
  with pytest.raises(ValueError, match="plain"):
    with hosts.stop_together():
      raise ValueError("plain")


_COMPACT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    jax.distributed.initialize({address!r}, 2, int(sys.argv[1]), heartbeat_timeout_seconds=10)
    from eppo_jax import agent, hosts, sampling
    from eppo_jax import mesh as meshlib
    from eppo_jax.models import hf
    from eppo_jax.policy import ModelPolicy
    host = jax.process_index()
    mesh = meshlib.make_mesh(meshlib.DATA_ONLY)
    pre = hf.load_pretrained({tiny!r}, mesh=mesh)
    cfg = sampling.SamplingConfig(max_new_tokens=6, greedy=True, stop_token_ids=(1,), pad_id=0)
    policies = {{c: ModelPolicy(pre.params, pre.config, cfg, 192, jax.random.PRNGKey(0), mesh,
                               compact=c) for c in (False, True)}}
    states = {{c: None for c in policies}}
    # Live rows per turn: host 0 keeps rows 1 and 5, then 5; host 1 keeps 4 rows, then 0 and 6.
    live = {{0: [range(8), (1, 5), (5,)], 1: [range(8), (0, 2, 3, 6), (0, 6)]}}[host]
    rng = np.random.default_rng(host)
    out = dict(rows=[], same=[])
    for rows in live:
      active = np.isin(np.arange(8), rows)
      agreed = agent.Agreed(rows=8, live=hosts.global_max(int(active.sum())))
      chunk, mask = sampling.left_pad(
          [list(rng.integers(5, 60, 9)) if a else [] for a in active], [32], 0)
      replies = {{c: p(chunk, mask, states[c], active, agreed) for c, p in policies.items()}}
      for c in policies:
        states[c] = replies[c][2]
      out["rows"].append(int(states[True]["mask"].shape[0]))
      out["same"].append(bool((replies[True][0][active] == replies[False][0][active]).all()
                              and (replies[True][1] == replies[False][1]).all()))
    with open(sys.argv[2], "w") as f:
      json.dump(out, f)
""")


def test_compaction_across_hosts_keeps_greedy_replies(tiny, tmp_path):
  """2 processes x 2 devices, 8 rows per host: the batch shrinks only once every host's live rows
  fit a quarter (2 per host), each host keeping its own rows, and the replies stay exactly those
  of the uncompacted batch."""
  script = tmp_path / "compact.py"
  script.write_text(_COMPACT.format(address=f"127.0.0.1:{pod.free_port()}", tiny=str(tiny)))
  out = pod.run_script(script, tmp_path, cwd=ROOT, timeout_s=300, devices=2)
  for host in out:
    assert host["rows"] == [16, 16, 4]  # Global rows: 2 hosts x 8, then 2 x 2.
    assert all(host["same"]), host


_SPLIT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    jax.distributed.initialize({address!r}, 2, int(sys.argv[1]), heartbeat_timeout_seconds=10)
    from jax.experimental import mesh_utils
    from eppo_jax import hosts
    from eppo_jax import mesh as meshlib
    d = jax.devices()  # Host 0's two devices, then host 1's.
    # A physical placement that puts each tensor pair across both hosts.
    mesh_utils.create_device_mesh = lambda shape, devices: np.asarray(
        [d[0], d[2], d[1], d[3]], dtype=object).reshape(shape)
    mesh = meshlib.make_mesh(meshlib.MeshConfig(data=2, fsdp=1, tensor=2))
    host = jax.process_index()
    rows = 10 * host + np.arange(2, dtype=np.float32)[:, None] + np.zeros((2, 3), np.float32)
    batch = hosts.put_rows({{"x": rows}}, mesh)["x"]
    with open(sys.argv[2], "w") as f:
      json.dump(dict(shape=list(batch.shape), rows=hosts.fetch(batch)[:, 0].tolist(),
                     back=bool((hosts.local_rows(batch, mesh) == rows).all()),
                     tensor=[[x.process_index for x in g] for g in mesh.devices.reshape(2, 2)]),
                f)
""")


def test_a_mesh_whose_batch_shards_span_hosts_is_laid_out_by_host(tmp_path):
  """2 processes x 2 devices, data 2 x tensor 2, a placement that splits each tensor pair over
  the hosts: the mesh is laid out so that each host holds a whole batch shard, and the global
  batch has all 4 rows (2 per host, each in its place)."""
  script = tmp_path / "split.py"
  script.write_text(_SPLIT.format(address=f"127.0.0.1:{pod.free_port()}"))
  for out in pod.run_script(script, tmp_path, cwd=ROOT, timeout_s=120, devices=2):
    assert out == dict(shape=[4, 3], rows=[0, 1, 10, 11], back=True, tensor=[[0, 0], [1, 1]])


def test_a_config_error_on_every_host_is_reported_as_itself(tmp_path):
  """run.py on 2 processes with instances that do not split over 2 hosts: every host raises the
  same ConfigError, so each prints run.py's one line and exits 1, and none blames the other."""
  port = pod.free_port()
  argv = lambda i: [sys.executable, "run.py", "--config=configs/multitask.py:smoke",
                    "--config.rollout.instances_per_step=3",
                    f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    "--config.distributed.num_processes=2",
                    f"--config.distributed.process_id={i}", f"--workdir={tmp_path / 'run'}"]
  codes = pod.wait_all(pod.launch(argv, 2, tmp_path, devices=1, cwd=ROOT), 120)
  logs = [pod.log_text(tmp_path, i) for i in range(2)]
  assert codes == [1, 1], logs
  for log in logs:
    assert log.strip().splitlines()[-1] == ("error: config.rollout.instances_per_step=3 does not "
                                            "split over 2 hosts"), log[-2000:]
