"""Run logs: the same records reach metrics.jsonl, TensorBoard and Weights & Biases (offline)."""

import glob
import json
import struct

import numpy as np
from tensorboardX.proto import event_pb2

from eppo_jax.metrics import MetricsLogger, chart_name

TASKS = ["sokoban:easy", "countdown:easy"]


def _tensorboard_scalars(workdir) -> dict:
  """{tag: [(step, value), ...]} read back from the TFRecord event files, without TensorBoard."""
  scalars = {}
  for path in glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):  # Record: uint64 length, uint32 crc, payload, uint32 crc.
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 16 + length
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def _log_a_run(logger):
  """Two SFT records (negative steps, as the trainer writes them) and two RL steps."""
  logger.log(-1, {"sft_loss": 2.0})
  logger.log(0, {"sft_loss": 1.5})
  for step in (1, 2):
    logger.log(step, {"loss": 0.1 * step, "entropy_crossovers": step, "reward": float("nan")},
               {"entropy": np.array([0.5, 1.0]) * step, "success": np.array([np.nan, 0.25])})


def test_tensorboard_and_wandb_get_the_jsonl_metric_names(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  logger = MetricsLogger(tmp_path, TASKS, 2, plots=False, wandb_project="eppo-test",
                         wandb_config={"method": "eppo"})
  _log_a_run(logger)
  summary = dict(logger._wandb.summary)  # pylint: disable=protected-access
  logger.close()

  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [-1, 0, 1, 2]
  logged = {k for r in records for k, v in r.items() if v is not None and k not in ("step", "time")}
  # NaN is JSON null and absent from both: no fake zeros.
  assert "reward" not in logged and "task/sokoban:easy/success" not in logged
  assert "task/countdown:easy/entropy" in logged

  # Both dashboards show ':' (not allowed in a TensorBoard tag) as '_', and nothing else changes.
  charted = {chart_name(k) for k in logged}
  assert "task/countdown_easy/entropy" in charted and len(charted) == len(logged)
  tb = _tensorboard_scalars(tmp_path)
  assert set(tb) == charted
  assert tb["task/countdown_easy/entropy"] == [(1, 1.0), (2, 2.0)]
  assert tb["sft_loss"] == [(-1, 2.0), (0, 1.5)]

  # W&B's summary holds each key's last value; "step" is the x-axis of every chart.
  assert {k for k in summary if not k.startswith("_")} == charted | {"step"}
  last = records[-1]
  for key in ("loss", "task/countdown:easy/entropy", "task/sokoban:easy/entropy"):
    np.testing.assert_allclose(summary[chart_name(key)], last[key])
  assert summary["sft_loss"] == 1.5 and summary["step"] == 2


def test_wandb_run_resumes_with_the_workdir(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  ids = []
  for _ in range(2):
    logger = MetricsLogger(tmp_path, TASKS, 2, tensorboard=False, plots=False,
                           wandb_project="eppo-test")
    ids.append(logger._wandb.id)  # pylint: disable=protected-access
    logger.close()
  assert ids[0] == ids[1] == (tmp_path / "wandb_run_id").read_text()


def _panels(fig) -> dict:
  """{title: [(label, x, y) of each line]} of the figure's visible panels."""
  return {ax.get_title(): [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                           for line in ax.get_lines()]
          for ax in fig.axes if ax.get_visible()}


def test_plots_draw_each_task_and_the_warm_start_loss(tmp_path):
  logger = MetricsLogger(tmp_path, TASKS, 2, tensorboard=False, wandb_project="")
  _log_a_run(logger)
  panels = _panels(logger.figure())
  assert panels["token entropy (nats)"] == [("sokoban:easy", [1, 2], [0.5, 1.0]),
                                            ("countdown:easy", [1, 2], [1.0, 2.0])]
  assert [line[1:] for line in panels["SFT warm start loss"]] == [([-1, 0], [2.0, 1.5])]
  assert len(panels) == 7  # The 3 x 3 grid's last 2 cells are hidden.
  logger.plot()
  assert (tmp_path / "plots.png").read_bytes().startswith(b"\x89PNG")
  logger.close()


def test_a_warm_start_alone_shows_its_loss_and_eval_with_a_legend(tmp_path):
  logger = MetricsLogger(tmp_path, TASKS, 0, tensorboard=False, wandb_project="")
  logger.log(-1, {"sft_loss": 2.0})
  logger.log(0, {"sft_loss": 1.5})
  logger.log(0, {}, {"eval_success": np.array([0.25, 0.5])})
  fig = logger.figure()
  eval_panel = [ax for ax in fig.axes if ax.get_title() == "eval success (greedy)"][0]
  assert eval_panel.get_legend() is not None
  assert [ax.get_legend() for ax in fig.axes if ax is not eval_panel] == [None] * 8
  assert _panels(fig)["SFT warm start loss"][0][1:] == ([-1, 0], [2.0, 1.5])
  logger.close()
