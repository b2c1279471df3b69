"""What a run logs: the metrics of a batch of episodes and of one RL step, and where they go (JSONL,
the source of truth; TensorBoard; optional Weights & Biases; a progress bar; per-task PNG plots).

The workdir may be a URL (gs://bucket/run), written through `etils.epath`. Object stores cannot
append, so there `metrics.jsonl` and the TensorBoard event file are kept in memory and rewritten
whole now and then (tensorboardX's own gs:// and s3:// writers do the same for event files).
"""

from __future__ import annotations

import io
import json
import math
import re
import time
import uuid
from typing import Optional

from etils import epath
import numpy as np

from eppo_jax.episodes import EpisodeBatch, training_rewards
from eppo_jax import workdir as workdir_lib

# Per-task series drawn in `plots.png`, one panel each.
PLOTTED = (("entropy", "token entropy (nats)"), ("eps_low", "clip bound ε_low"),
           ("eps_high", "clip bound ε_high"), ("success", "train success"),
           ("eval_success", "eval success (greedy)"), ("clip_frac", "clip fraction"))


def chart_name(key: str) -> str:
  """A record key as TensorBoard and W&B show it.

  Characters other than letters, digits and "_-/." (the ':' of a task spec) become '_', the rule
  TensorBoard applies to tags, so both dashboards show one name.
  """
  return re.sub(r"[^-/\w.]", "_", key)


def _scalar(value):
  value = float(np.asarray(value))
  return value if math.isfinite(value) else None  # JSON has no NaN; None keeps the key visible.


class _RewrittenFile:
  """A file at a URL written whole from memory: at the first flush, at most every `every_s`
  seconds after, and on close (a crash loses at most the last `every_s` seconds)."""

  def __init__(self, path: epath.Path, binary: bool = False, every_s: float = 60.0):
    self._path = path
    self._buffer = io.BytesIO() if binary else io.StringIO()
    self._every_s = every_s
    self._last = -math.inf
    self._size = -1  # What the stored copy holds; -1 before the first write.

  def write(self, data) -> None:
    self._buffer.write(data)

  def flush(self) -> None:
    if time.monotonic() - self._last >= self._every_s:
      self.close()

  def close(self) -> None:
    if self._buffer.tell() == self._size:
      return  # Nothing new since the last write.
    data = self._buffer.getvalue()
    self._size = self._buffer.tell()
    if isinstance(data, bytes):
      self._path.write_bytes(data)
    else:
      self._path.write_text(data)
    self._last = time.monotonic()


class _EventFilesAtUrls:
  """A tensorboardX writer factory for URL log directories, through epath; tensorboardX flushes
  the event file every `flush_secs` (120 s) and on close."""

  def open(self, path: str) -> _RewrittenFile:
    return _RewrittenFile(epath.Path(path), binary=True, every_s=0.0)

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _summary_writer(logdir: epath.Path):
  """A tensorboardX SummaryWriter; for a URL its event file goes through epath like every other
  file of the workdir (tensorboardX's own writers know gs:// and s3:// only, each through a
  client of its own)."""
  # pylint: disable-next=g-import-not-at-top
  from tensorboardX import SummaryWriter, record_writer
  scheme = workdir_lib.url_scheme(logdir)
  if scheme is not None:
    record_writer.register_writer_factory(scheme, _EventFilesAtUrls())
  return SummaryWriter(str(logdir))


def flatten(step: int, scalars: dict, per_task: dict, task_names) -> dict:
  """One JSON record: global scalars plus `task/<name>/<metric>` keys."""
  record = {"step": int(step)}
  record.update({k: _scalar(v) for k, v in scalars.items()})
  for metric, values in per_task.items():
    for name, value in zip(task_names, np.asarray(values).reshape(-1)):
      record[f"task/{name}/{metric}"] = _scalar(value)
  return record


def _per_task(values: np.ndarray, task_ids: np.ndarray, num_tasks: int,
              valid: np.ndarray | None = None) -> np.ndarray:
  """Mean of the `valid` `values` per task ([K], NaN for tasks with none in the batch)."""
  valid = np.ones(len(values), bool) if valid is None else valid
  values = np.where(valid, values, 0.0).astype(np.float64)
  sums = np.bincount(task_ids, weights=values, minlength=num_tasks)
  counts = np.bincount(task_ids, weights=valid.astype(np.float64), minlength=num_tasks)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / counts, np.nan)


def _per_task_tokens(values_BxT: np.ndarray, mask_BxT: np.ndarray, task_ids: np.ndarray,
                     num_tasks: int) -> np.ndarray:
  """Mean of `values` over each task's `mask`ed tokens ([K], NaN for tasks with none)."""
  sums = np.bincount(task_ids, weights=np.where(mask_BxT, values_BxT, 0.0).sum(1),
                     minlength=num_tasks)
  counts = np.bincount(task_ids, weights=mask_BxT.sum(1), minlength=num_tasks)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / counts, np.nan)


def episode_metrics(episodes: EpisodeBatch, num_tasks: int, prefix: str = "") -> tuple:
  """(global scalars, per-task arrays) of a batch of episodes."""
  finite = np.isfinite(episodes.rewards)
  scored = finite & ~episodes.failed  # A failed episode's return is not a score.
  per_task = {
      f"{prefix}success": _per_task(episodes.success, episodes.task_ids, num_tasks),
      f"{prefix}reward": _per_task(episodes.rewards, episodes.task_ids, num_tasks, scored),
      f"{prefix}invalid_actions": _per_task(episodes.invalid_actions, episodes.task_ids,
                                            num_tasks),
      f"{prefix}turns": _per_task(episodes.turns, episodes.task_ids, num_tasks),
      f"{prefix}episode_tokens": _per_task(episodes.num_tokens, episodes.task_ids, num_tasks),
  }
  scalars = {
      f"{prefix}success": episodes.success.mean(),
      # Over the healthy episodes: one inf must not hide the others, nor a crash count as a score.
      f"{prefix}reward": episodes.rewards[scored].mean() if scored.any() else np.nan,
      f"{prefix}env_failures": episodes.failed.sum(),
      f"{prefix}nonfinite_rewards": (~finite).sum(),
      f"{prefix}truncated": episodes.truncated.mean(),
      f"{prefix}response_tokens": episodes.loss_mask.sum(1).mean(),
  }
  if not prefix:  # Training batches (evaluation has no groups and no update).
    scalars["excluded_episodes"] = np.isnan(training_rewards(episodes)).sum()
    if episodes.action_mask is not None:  # The sampler's entropy where the decision is.
      per_task["action_entropy"] = _per_task_tokens(
          episodes.entropies, episodes.action_mask & episodes.loss_mask, episodes.task_ids,
          num_tasks)
  return scalars, per_task


# Batch statistics of a task with no tokens in the batch are NaN (absent), not 0.
_TOKEN_STATISTICS = ("entropy", "clip_frac_low", "clip_frac_high", "approx_kl", "pg_loss")


def step_metrics(episodes: EpisodeBatch, update: dict, num_tasks: int, play_s: float,
                 env_s: float, total_s: float) -> tuple[dict, dict]:
  """(global scalars, per-task arrays) of one RL step: its episodes (of all hosts), the update's
  metrics (`steps.train_step`; `*_K` keys are per task) and the step's timings in seconds."""
  scalars, per_task = episode_metrics(episodes, num_tasks)
  per_task.update({k[:-2]: v for k, v in update.items() if k.endswith("_K")})
  absent = update["token_count_K"] == 0
  for key in _TOKEN_STATISTICS:
    per_task[key] = np.where(absent, np.nan, per_task[key])
  per_task["clip_frac"] = per_task["clip_frac_low"] + per_task["clip_frac_high"]
  scalars.update({k: v for k, v in update.items() if not k.endswith("_K")})
  scalars.update({"time/generation_s": play_s - env_s, "time/environment_s": env_s,
                  "time/update_s": total_s - play_s, "time/step_s": total_s,
                  "tokens_per_s": episodes.attention_mask.sum() / total_s})
  return scalars, per_task


def progress_summary(names, success) -> str:
  """Live per-task success for the progress bar ("-" for a task absent from this batch)."""
  return " ".join(f"{n.split(':')[0][:6]} " + ("-" if np.isnan(s) else f"{s:.2f}")
                  for n, s in zip(names, success))


class MetricsLogger:
  """Writes each record to `metrics.jsonl` and TensorBoard, and keeps the history for plots.

  Only the first process of a multi-host job writes; the others keep the history in memory, so a
  checkpoint taken on any host holds the same metrics.
  """

  def __init__(self, workdir, task_names, total_steps: int, *, tensorboard: bool = True,
               plots: bool = True, write: bool = True, history: Optional[list] = None,
               wandb_project: str = "", wandb_config: Optional[dict] = None):
    self.workdir = workdir_lib.as_path(workdir)
    self.task_names = list(task_names)
    self.history = list(history or [])
    self._plots = plots and write
    self._write = write
    self._tb = None
    self._bar = None  # The live tqdm bar and the phase it counts ("sft" or "rl").
    self._bar_phase = None
    self._total = total_steps
    if write:
      self.workdir.mkdir(parents=True, exist_ok=True)
      # Rewritten from the given history: a resumed run drops records past its checkpoint.
      jsonl = self.workdir / "metrics.jsonl"
      self._jsonl = (_RewrittenFile(jsonl) if workdir_lib.url_scheme(jsonl)
                     else open(jsonl, "w", encoding="utf-8"))
      for record in self.history:
        self._jsonl.write(json.dumps(record) + "\n")
      if tensorboard:
        self._tb = _summary_writer(self.workdir / "tensorboard")
    self._wandb = _wandb_run(self.workdir, wandb_project, wandb_config) if (
        write and wandb_project) else None

  def log(self, step: int, scalars: dict, per_task: Optional[dict] = None) -> dict:
    record = flatten(step, scalars, per_task or {}, self.task_names)
    record["time"] = time.time()
    self.history.append(record)
    if self._write:
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
      if self._tb is not None:
        for key, value in record.items():
          if key not in ("step", "time") and value is not None:
            self._tb.add_scalar(chart_name(key), value, step)
      if self._wandb is not None:
        self._wandb.log({chart_name(k): v for k, v in record.items()
                         if k != "time" and v is not None})
    return record

  def progress(self, step: int, summary: str, phase: str = "rl",
               total: Optional[int] = None) -> None:
    """A tqdm bar with ETA per phase ("sft", "rl"; `total` defaults to the RL steps); `summary`
    is a short live text such as the loss or per-task success."""
    if not self._write:
      return
    if self._bar_phase != phase:
      self.end_progress()
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      # Starts at this step: the ETA then counts only steps timed in this process.
      self._bar = tqdm(total=total or self._total, initial=step, desc=phase, dynamic_ncols=True)
      self._bar_phase = phase
    else:
      self._bar.update(step - self._bar.n)
    self._bar.set_postfix_str(summary, refresh=True)

  def end_progress(self) -> None:
    """Closes the current phase's bar, so its rate and time stop where the phase did."""
    if self._bar is not None:
      self._bar.close()
    self._bar = self._bar_phase = None

  def series(self, key: str):
    """(steps, values) of one key over the history, skipping records without it."""
    points = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
    return tuple(np.array(v) for v in zip(*points)) if points else (np.array([]), np.array([]))

  def plot(self) -> Optional[epath.Path]:
    """Per-task curves of entropy, bounds and success, and the SFT warm start's loss where the run
    trained one -> `plots.png` in the workdir."""
    if not self._plots or not self.history:
      return None
    fig = self.figure()
    path = self.workdir / "plots.png"
    png = io.BytesIO()  # savefig writes local files only; the bytes go through epath.
    fig.savefig(png, format="png", dpi=90)
    path.write_bytes(png.getvalue())
    return path

  def figure(self):
    """The figure `plot` writes: one panel per `PLOTTED` metric (a line per task), then the SFT
    loss against its step (0 = the warm start's end) where the history has one."""
    # A bare Figure renders with Agg by itself: no pyplot, so the process's matplotlib backend
    # (a notebook's inline one, say) is left as it was.
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
    sft_steps, sft_loss = self.series("sft_loss")
    panels = len(PLOTTED) + (len(sft_steps) > 0)
    cols = 3
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(5 * cols, 3.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).flat
    for ax, (metric, title) in zip(axes, PLOTTED):
      for name in self.task_names:
        steps, values = self.series(f"task/{name}/{metric}")
        if len(steps):
          ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=name)
      ax.set_title(title)
      ax.set_xlabel("RL step")
      ax.grid(alpha=0.3)
      # Values as they are: a bound that stays at 0.2 is not drawn as "1e-7 + 1.99997e-1".
      ax.ticklabel_format(axis="y", useOffset=False)
    # The task legend goes on the first panel with a curve (an SFT-only run has eval points only).
    drawn = [ax for ax in axes[:len(PLOTTED)] if ax.get_legend_handles_labels()[0]]
    if drawn:
      drawn[0].legend(fontsize=8)
    if len(sft_steps):
      ax = axes[len(PLOTTED)]
      ax.plot(sft_steps, sft_loss, marker="." if len(sft_steps) < 30 else None)
      ax.set_yscale("log")
      ax.set_title("SFT warm start loss")
      ax.set_xlabel("SFT step (0 = its end)")
      ax.grid(alpha=0.3)
    for ax in axes[panels:]:
      ax.set_visible(False)
    fig.tight_layout()
    return fig

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._write:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.finish()


def _wandb_run(workdir: epath.Path, project: str, config: Optional[dict]):
  """A W&B run for this workdir: a rerun that resumes the workdir continues the same W&B run.

  Records carry their own "step" (negative during SFT), used as every chart's x-axis; W&B's own
  step only counts calls. `WANDB_MODE=offline` keeps everything local (`wandb sync` later); W&B's
  files go in the workdir, or in its default ./wandb for a URL workdir (it writes locally only).
  """
  import wandb  # pylint: disable=g-import-not-at-top
  id_file = workdir / "wandb_run_id"
  run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
  id_file.write_text(run_id)
  run = wandb.init(project=project, name=workdir.name, id=run_id, resume="allow",
                   dir=None if workdir_lib.url_scheme(workdir) else str(workdir), config=config)
  run.define_metric("step")
  run.define_metric("*", step_metric="step")
  return run
