"""A workdir at a URL (gs://BUCKET/run): every file lands in the bucket, none in a local `gs:`
folder.

The bucket is a local directory (`fake_gcs.served_from`), reached through the same epath and orbax
code paths as GCS.
"""

import json
import logging
import os
import sys
import textwrap

import jax
import numpy as np
import pytest

import fake_gcs
from eppo_jax import train, workdir
from eppo_jax.checkpoint import Checkpointer
from eppo_jax.metrics import MetricsLogger
from pipeline_util import ROOT, read_records, smoke_config
from test_metrics import TASKS, _log_a_run, _tensorboard_scalars
from test_reliability import _damage

sys.path.insert(0, str(ROOT / "bench"))
import pod  # pylint: disable=g-import-not-at-top,wrong-import-position

URL = "gs://bucket/run"


@pytest.fixture
def gcs(tmp_path, monkeypatch):
  """The local directory behind gs://; the test runs in an empty current directory."""
  root = tmp_path / "gcs"
  root.mkdir()
  (tmp_path / "cwd").mkdir()
  monkeypatch.chdir(tmp_path / "cwd")
  with fake_gcs.served_from(root):
    yield root
  assert not os.listdir(tmp_path / "cwd"), "something went to a path relative to the cwd"


def _state(step):
  return {"a": np.arange(1000, dtype=np.float32) * step, "b": np.full((3, 4), step, np.int32)}


def test_checkpoints_save_restore_and_fall_back_at_a_url(gcs, caplog):
  ckpt = Checkpointer(URL + "/checkpoints", keep=3)
  assert str(ckpt.directory) == URL + "/checkpoints"
  for step in (1, 2):
    ckpt.save(step, _state(step), {"step": step})
  stored = gcs / "bucket" / "run" / "checkpoints"
  assert sorted(os.listdir(stored)) == ["1", "2"]
  # Orbax took its GCS path: a commit file marks a finished step (no rename on an object store).
  assert (stored / "2" / "commit_success.txt").exists()
  state, meta = ckpt.restore(_state(0))
  assert meta == {"step": 2}
  np.testing.assert_array_equal(state["a"], _state(2)["a"])

  _damage(stored / "2")
  with caplog.at_level(logging.WARNING):
    step, state, meta = ckpt.restore_intact(_state(0))
  assert step == 1 and meta == {"step": 1}
  np.testing.assert_array_equal(state["b"], _state(1)["b"])
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and f"{URL}/checkpoints/2 is unreadable" in warnings[0], warnings
  # Set aside through epath, next to the checkpoints in the bucket.
  assert ckpt.all_steps() == [1] and (gcs / "bucket" / "run" / "checkpoints.unreadable" / "2" /
                                      "commit_success.txt").exists()
  ckpt.save(2, _state(2), {"step": 2})
  assert ckpt.restore_intact(_state(0))[0] == 2
  ckpt.close()


def test_a_relative_local_checkpoint_directory_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  ckpt = Checkpointer("run/checkpoints")
  assert str(ckpt.directory) == str(tmp_path / "run" / "checkpoints")
  ckpt.close()


def test_metrics_at_a_url_match_a_local_run(gcs, tmp_path):
  """metrics.jsonl, TensorBoard and plots.png land in the bucket, as a local workdir gets them."""
  loggers = {where: MetricsLogger(where, TASKS, 2) for where in (URL, tmp_path / "local")}
  stored = gcs / "bucket" / "run"
  for where, logger in loggers.items():
    logger.log(-1, {"sft_loss": 2.0})
    if where == URL:  # The first record is written at once; later ones wait (no appends on GCS).
      assert [r["step"] for r in read_records(stored)] == [-1]
    _log_a_run(logger)
    if where == URL:
      assert [r["step"] for r in read_records(stored)] == [-1]
    assert logger.plot() == workdir.as_path(where) / "plots.png"
    logger.close()

  local = tmp_path / "local"
  untimed = lambda path: [{k: v for k, v in r.items() if k != "time"} for r in read_records(path)]
  assert [r["step"] for r in read_records(stored)] == [-1, -1, 0, 1, 2]
  assert untimed(stored) == untimed(local)
  assert _tensorboard_scalars(stored) == _tensorboard_scalars(local)
  assert len(_tensorboard_scalars(stored)["sft_loss"]) == 3
  png = (stored / "plots.png").read_bytes()
  assert png.startswith(b"\x89PNG") and png == (local / "plots.png").read_bytes()


def test_claim_records_the_run_at_a_url_and_refuses_another(gcs, tmp_path):
  config = smoke_config(tmp_path / "no_model")
  assert workdir.claim(config, URL) == {}
  workdir.claim(config, tmp_path / "local")
  stored = gcs / "bucket" / "run"
  assert sorted(os.listdir(stored)) == ["config.json", "run_info.json"]  # No .tmp left behind.
  assert (stored / "config.json").read_bytes() == (tmp_path / "local" / "config.json").read_bytes()

  changed = smoke_config(tmp_path / "no_model", method="grpo")
  with pytest.raises(workdir.WorkdirConflict, match="method: 'eppo' -> 'grpo'"):
    workdir.claim(changed, URL)
  assert workdir.claim(config, URL) == {}
  info = json.loads((stored / "run_info.json").read_text())
  assert len(info["previous_starts"]) == 1

  workdir.write_atomic(URL + "/final_metrics.json", json.dumps({"step": 3}))
  assert json.loads((stored / "final_metrics.json").read_text()) == {"step": 3}
  assert not (stored / "final_metrics.tmp").exists()


def test_a_tiny_model_at_a_url_is_built_once_and_read_by_every_host(gcs, tmp_path, monkeypatch):
  """`model.tiny_dir=gs://...`: host 0 builds the model in its cache and puts it in the bucket;
  another host, with an empty cache, reads it from there: the same weights and tokenizer."""
  monkeypatch.setattr(train.hosts, "barrier", lambda name: None)
  config = smoke_config("gs://bucket/tiny")
  models = []
  for host in (0, 1):
    monkeypatch.setenv("HOME", str(tmp_path / f"home{host}"))
    monkeypatch.setattr(train.jax, "process_index", lambda host=host: host)
    models.append(train.load_model(config, URL))
  stored = gcs / "bucket" / "tiny"
  assert {"config.json", "model.safetensors", "eppo_jax_tiny.json"} <= set(os.listdir(stored))
  cached = tmp_path / "home1" / ".cache" / "eppo_jax" / "workdirs" / "gs" / "bucket" / "tiny"
  assert (cached / "model.safetensors").read_bytes() == (stored / "model.safetensors").read_bytes()
  (_, params0, tok0), (_, params1, tok1) = models
  jax.tree_util.tree_map(np.testing.assert_array_equal, params0, params1)
  assert tok0.get_vocab() == tok1.get_vocab()
  # Host 0 on a fresh machine (empty cache) takes the bucket's build rather than its own.
  monkeypatch.setenv("HOME", str(tmp_path / "home2"))
  monkeypatch.setattr(train.jax, "process_index", lambda: 0)
  (stored / "eppo_jax_tiny.json").write_text((stored / "eppo_jax_tiny.json").read_text() + " ")
  train.load_model(config, URL)
  assert (tmp_path / "home2" / ".cache" / "eppo_jax" / "workdirs" / "gs" / "bucket" / "tiny" /
          "eppo_jax_tiny.json").read_text().endswith(" ")


def test_url_without_its_packages_fails_in_one_line_before_writing(gcs, tmp_path, monkeypatch):
  monkeypatch.setattr(workdir, "URL_PACKAGES", {"gs": ("eppo_jax_absent_module",)})
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  # From train(): before the tiny model is built or anything compiles.
  config = smoke_config("", **{"train.compilation_cache": ""})
  with pytest.raises(workdir.WorkdirUnusable) as error:
    train.train(config, URL)
  message = str(error.value)
  assert "\n" not in message and "eppo_jax_absent_module" in message
  assert "pip install 'eppo_jax[gcs]'" in message
  assert not os.listdir(gcs) and not (tmp_path / "home").exists()
  with pytest.raises(workdir.WorkdirUnusable, match="not ftp://"):
    workdir.as_path("ftp://host/run")


def test_train_at_a_url_writes_every_file_there_and_resumes_from_it(gcs, tmp_path, monkeypatch,
                                                                     caplog):
  """No RL step (the cheapest run): the tiny model, the step-0 evaluation and checkpoint; a rerun
  resumes from the checkpoint in the bucket."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  config = smoke_config("", **{"train.num_steps": 0, "sft.enabled": False,
                               "train.compilation_cache": ""})
  record = train.train(config, URL)
  stored = gcs / "bucket" / "run"
  assert sorted(os.listdir(stored)) == ["checkpoints", "config.json", "final_metrics.json",
                                        "metrics.jsonl", "plots.png", "run_info.json",
                                        "tensorboard", "tiny_model"]
  assert os.listdir(stored / "checkpoints") == ["0"]
  assert [r["step"] for r in read_records(stored)] == [0] and "eval_success" in record
  assert json.loads((stored / "final_metrics.json").read_text()) == record
  # The checkpoint, saved before the evaluation, records it as done, through the URL.
  meta = json.loads((stored / "checkpoints" / "0" / "meta" / "metadata").read_text())
  assert not meta["eval_due"] and [r["step"] for r in meta["history"]] == [0]
  assert (tmp_path / "home" / ".cache" / "eppo_jax" / "workdirs" / "gs" / "bucket" / "run" /
          "tiny_model" / "model.safetensors").exists()

  with caplog.at_level(logging.INFO, logger="eppo_jax"):
    again = train.train(config, URL)  # Nothing left to do: step 0's records come back.
  untimed = lambda r: {k: v for k, v in r.items() if k != "time"}
  assert untimed(again) == untimed(record)
  assert f"resumed from {URL}/checkpoints/0 at RL step 0" in caplog.text
  assert len(json.loads((stored / "run_info.json").read_text())["previous_starts"]) == 1


# ----------------------------------------------------------------------------------------------
# Two hosts.

_HOST = textwrap.dedent("""
    import json, logging, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    sys.path.insert(0, {tests!r})
    import jax
    import numpy as np
    from etils import epath
    import orbax.checkpoint as ocp
    process = int(sys.argv[1])
    jax.distributed.initialize({address!r}, num_processes=2, process_id=process)
    import fake_gcs
    from eppo_jax import checkpoint

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("eppo_jax").addHandler(handler)
    out = {{}}

    # Each host's own directory, one with more checkpoints: refused on both hosts.
    try:
      checkpoint.Checkpointer({own!r}[process]).restore_intact({{"b": np.zeros(3, np.int32)}})
    except checkpoint.HostsDisagree as e:
      out["disagree"] = str(e)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    def state(step):
      a = jax.make_array_from_callback((8,), sharding,
                                       lambda i: np.arange(8.0, dtype=np.float32)[i] * step)
      return {{"a": a, "b": np.full(3, step, np.int32)}}
    like = {{"a": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding),
             "b": np.zeros(3, np.int32)}}

    failures = []
    read = ocp.CompositeCheckpointHandler.restore
    def read_fails_once_on_host_1(self, directory, *args, **kwargs):
      if process == 1 and epath.Path(directory).name == "2" and not failures:
        failures.append(1)
        raise OSError("injected read error on host 1")
      return read(self, directory, *args, **kwargs)
    ocp.CompositeCheckpointHandler.restore = read_fails_once_on_host_1
    # orbax's barriers are orbax's: no code here may join one by its name.
    joined, orbax_barrier = [], ocp.multihost.sync_global_processes
    def barrier(name, **kwargs):
      if sys._getframe(1).f_globals.get("__name__", "").startswith("eppo_jax"):
        joined.append(name)
      return orbax_barrier(name, **kwargs)
    ocp.multihost.sync_global_processes = barrier

    with fake_gcs.served_from({root!r}):
      ckpt = checkpoint.Checkpointer({url!r} + "/checkpoints", keep=3)
      for step in (1, 2):
        ckpt.save(step, state(step), {{"step": step}})
      step, restored, meta = ckpt.restore_intact(like)
      out["fallback"] = [step, meta, ckpt.all_steps(),
                         [np.asarray(s.data).tolist() for s in restored["a"].addressable_shards]]
      ckpt.save(2, state(2), {{"step": 2}})
      out["again"] = ckpt.restore_intact(like)[0]
      ckpt.close()
    out["warnings"], out["joined"] = warnings, joined
    with open(sys.argv[2], "w") as f:
      json.dump(out, f)
""")


def test_two_hosts_restore_the_same_step_when_one_cannot_read(tmp_path):
  """Step 2 reads back on host 0, not on host 1: both restore step 1, host 0 sets 2 aside."""
  own = [str(tmp_path / f"own{i}") for i in range(2)]
  for directory, steps in zip(own, ([1], [1, 2])):
    ckpt = Checkpointer(directory)
    for step in steps:
      ckpt.save(step, {"b": np.full(3, step, np.int32)}, {})
    ckpt.close()
  root = tmp_path / "gcs"
  root.mkdir()
  script = tmp_path / "host.py"
  script.write_text(_HOST.format(tests=str(ROOT / "tests"),
                                 address=f"127.0.0.1:{pod.free_port()}", own=own,
                                 root=str(root), url=URL))
  out = pod.run_script(script, tmp_path, cwd=tmp_path, timeout_s=120)
  for host in out:
    assert "different checkpoints" in host["disagree"]
  # Host i holds elements 4i..4i+3 of `a`, which are their index times the step.
  for i, host in enumerate(out):
    assert host["fallback"] == [1, {"step": 1}, [1], [list(range(4 * i, 4 * i + 4))]]
  assert out[0]["again"] == out[1]["again"] == 2
  assert out[0]["joined"] == out[1]["joined"] == []
  assert "read back here, not on every host" in out[0]["warnings"][0]
  assert "injected read error on host 1" in out[1]["warnings"][0]
  assert (root / "bucket" / "run" / "checkpoints.unreadable" / "2").is_dir()
  assert not (tmp_path / "gs:").exists()
