"""The evidence study: its statistics against independent computations, and the driver end to end."""

from __future__ import annotations

import itertools
import json
import shutil
import sys

import numpy as np
import pytest

from pipeline_util import ROOT, compile_cache, read_records  # pylint: disable=unused-import

sys.path.insert(0, str(ROOT / "bench"))

import study  # pylint: disable=g-import-not-at-top,wrong-import-position
import study_report  # pylint: disable=g-import-not-at-top,wrong-import-position
import study_stats as stats  # pylint: disable=g-import-not-at-top,wrong-import-position

TASKS = ("a", "b", "c")


def _record(step, entropies=None, evals=None, spikes=0):
  """A synthetic metrics.jsonl record: per-task entropies (None = absent) and eval successes."""
  r = {"step": step}
  if entropies is not None:
    r.update({f"task/{t}/entropy": h for t, h in zip(TASKS, entropies)})
    r["num_entropy_spikes"] = spikes
  if evals is not None:
    r.update({f"task/{t}/eval_success": s for t, s in zip(TASKS, evals)})
    r["eval_success"] = float(np.mean(evals))
  return r


# ----------------------------------------------------------------------------------------------
# Statistics.


def test_bootstrap_ci_matches_the_exact_bootstrap_distribution():
  """With 5 values every resample can be enumerated (5^5): the Monte Carlo percentiles agree."""
  values = np.array([0.12, -0.05, 0.31, 0.02, 0.2])
  means = np.array([values[list(idx)].mean() for idx in itertools.product(range(5), repeat=5)])
  exact = np.percentile(means, [2.5, 97.5])
  low, high = stats.bootstrap_ci(values, 0.95, num_resamples=10_000, seed=0)
  # The Monte Carlo quantile's standard error is about 0.002 here.
  np.testing.assert_allclose([low, high], exact, atol=0.01)
  assert low < values.mean() < high
  # Fixed RNG seed: the same interval every time; another seed moves it only by MC noise.
  assert stats.bootstrap_ci(values, 0.95, 10_000, 0) == (low, high)
  np.testing.assert_allclose(stats.bootstrap_ci(values, 0.95, 10_000, 1), exact, atol=0.01)


def test_bootstrap_means_equal_a_resampling_loop():
  """The vectorised resampling is the plain loop over resamples with the same index draws."""
  values = np.array([0.3, 0.1, 0.7, 0.4])
  rng = np.random.default_rng(7)
  index = rng.integers(0, len(values), size=(200, len(values)))
  loop = [sum(values[i] for i in row) / len(row) for row in index]
  np.testing.assert_allclose(stats.bootstrap_means(values, 200, seed=7), loop, rtol=1e-12)


def test_bootstrap_ci_of_a_large_sample_is_the_normal_interval():
  values = np.random.default_rng(3).normal(0.1, 0.2, size=400)
  low, high = stats.bootstrap_ci(values)
  half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
  np.testing.assert_allclose([low, high], [values.mean() - half, values.mean() + half],
                             atol=0.15 * half)
  assert stats.bootstrap_ci([0.25, 0.25, 0.25]) == (0.25, 0.25)
  with pytest.raises(ValueError, match="non-empty"):
    stats.bootstrap_ci([])


def test_verdict_applies_the_decision_rule():
  assert stats.verdict((0.01, 0.2)) == "effect"
  assert stats.verdict((-0.3, -0.001)) == "effect"
  assert stats.verdict((-0.04, 0.05)) == "clear null"  # Half-width 0.045.
  assert stats.verdict((-0.06, 0.05)) == "unresolved"  # Half-width 0.055.
  assert stats.verdict(None) == "unresolved"
  # Fewer seeds than the protocol's: no decision, however narrow the (degenerate) interval.
  assert stats.verdict((0.078, 0.078), n=1) == "pending (n < 5)"
  assert stats.verdict((0.01, 0.2), n=5) == "effect"


def test_paired_differences_keep_the_seeds_both_methods_have():
  diff = stats.paired_differences({0: 0.5, 1: 0.25, 3: 0.75}, {0: 0.25, 1: 0.5, 2: 0.0})
  assert diff == {0: 0.25, 1: -0.25}


def test_normalized_auc_is_the_trapezoid_rule_over_the_span():
  # 20 * (0.2 + 0.4) / 2 + 20 * (0.4 + 0.3) / 2 + 60 * (0.3 + 0.5) / 2 = 6 + 7 + 24 = 37.
  assert stats.normalized_auc([0, 20, 40, 100], [0.2, 0.4, 0.3, 0.5]) == pytest.approx(0.37)
  assert stats.normalized_auc([5, 10, 30], [0.6, 0.6, 0.6]) == pytest.approx(0.6)
  with pytest.raises(ValueError, match="increase"):
    stats.normalized_auc([0, 10, 10], [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match=">= 2"):
    stats.normalized_auc([0], [0.1])


def test_collapse_events_count_each_fall_below_the_threshold():
  series = list(enumerate([0.3, 0.04, 0.03, 0.2, 0.01, 0.05, 0.049], start=1))
  assert stats.collapse_events(series) == 3  # Steps 2, 5 and 7; 0.05 itself is not collapsed.
  assert stats.collapse_events([(1, 0.01), (2, 0.02)]) == 1  # Collapsed from the first step.
  assert stats.collapse_events([]) == 0


def test_crossovers_on_hand_counted_records():
  records = [
      _record(0, evals=[0.1, 0.2, 0.3]),  # Eval only: no entropies.
      _record(1, [0.5, 0.3, 0.1]),
      _record(2, [0.2, 0.3, 0.1]),        # a < b now: 1 flip (a, b); a == c? no: 0.2 > 0.1.
      _record(3, [0.2, 0.3, 0.4]),        # c passes a and b: 2 flips.
      _record(4, [None, 0.5, 0.35]),      # a absent; b passes c: 1 flip.
      _record(5, [0.45, 0.2, 0.35]),      # a vs its last (0.2): passes c and b; b drops below c.
  ]
  # Step 5 against the last observed values a=0.2, b=0.5, c=0.35: (a,b) flips, (a,c) flips,
  # (b,c) flips: 3.
  assert stats.count_crossovers(records, TASKS) == 1 + 2 + 1 + 3


def test_crossovers_match_the_trainers_definition_on_random_series():
  """The recount from logged entropies equals `pacing.entropy_crossovers` step by step."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from eppo_jax import pacing  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  ent_TxK = rng.uniform(0.0, 1.0, size=(60, 3)).round(1)  # Rounded: ties occur and never count.
  present_TxK = rng.uniform(size=(60, 3)) > 0.2
  records, total = [], 0
  last_K, seen_K = np.zeros(3, np.float32), np.zeros(3, bool)
  for t, (ent_K, present_K) in enumerate(zip(ent_TxK, present_TxK)):
    records.append(_record(t + 1, [float(h) if p else None for h, p in zip(ent_K, present_K)]))
    count = pacing.entropy_crossovers(jnp.asarray(last_K), jnp.asarray(ent_K, jnp.float32),
                                      jnp.asarray(seen_K & present_K))
    total += int(count)
    last_K = np.where(present_K, ent_K, last_K).astype(np.float32)
    seen_K |= present_K
  assert total > 10
  assert stats.count_crossovers(records, TASKS) == total


def test_run_metrics_of_a_synthetic_run():
  records = [_record(-2) | {"sft_loss": 1.0}, _record(0, evals=[0.0, 0.5, 1.0])]
  entropies = [[0.5, 0.1, 0.3], [0.4, 0.04, 0.3], [0.2, 0.03, 0.5], [0.1, 0.2, 0.6]]
  for step, h in enumerate(entropies, start=1):
    records.append(_record(step, h, spikes=step % 2))
  records[-3].update(_record(2, evals=[0.5, 0.5, 0.5]))
  records[-1].update(_record(4, evals=[0.25, 0.75, 1.0]))
  m = stats.run_metrics(records, TASKS)
  assert m["rl_steps"] == 4
  assert m["start_success"] == pytest.approx(0.5)
  assert m["final_success"] == pytest.approx(2.0 / 3.0)
  assert m["worst_task_final"] == 0.25
  # Task a: (0 + 0.5) / 2 * 2 + (0.5 + 0.25) / 2 * 2 = 1.25 over 4 steps.
  assert m["per_task_auc"]["a"] == pytest.approx(1.25 / 4)
  assert m["worst_task_auc"] == pytest.approx(1.25 / 4)
  # b: (0.5 + 0.5) + (0.5 + 0.75) = 2.25; c: (1 + 0.5) + (0.5 + 1) = 3; the mean curve's area is
  # the mean of the tasks' areas.
  assert m["auc_success"] == pytest.approx(np.mean([1.25, 2.25, 3.0]) / 4)
  assert m["per_task_collapse_events"] == {"a": 0, "b": 1, "c": 0}
  # Steps 2->3: c passes a (1); 3->4: b passes a (1).
  assert m["crossovers_per_100"] == pytest.approx(100 * 2 / 4)
  assert m["spikes_per_100"] == pytest.approx(100 * 2 / 4)
  assert m["entropy_end"]["c"] == pytest.approx(np.mean([0.3, 0.5, 0.6]))


# ----------------------------------------------------------------------------------------------
# The driver.


def test_config_passthrough_types_and_errors():
  base = study.base_config("study", study.parse_overrides(
      ["--config.train.num_steps=7", "--config.optim.learning_rate=1e-4",
       "--config.tasks.specs=('sokoban:easy','countdown:easy')", "--config.model.source=tiny"]))
  assert base.train.num_steps == 7 and base.optim.learning_rate == 1e-4
  assert base.tasks.specs == ("sokoban:easy", "countdown:easy")
  assert base.train.eval_instances_per_task == study.STUDY_OVERRIDES[
      "train.eval_instances_per_task"]
  hf = study.base_config("qwen2.5-0.5b", study.parse_overrides(["--config.model.source=/m"]))
  assert hf.model.source == "/m" and hf.model.lora_rank == 32  # The preset, unchanged otherwise.
  with pytest.raises(ValueError, match="unknown config field 'train.nope'"):
    study.base_config("smoke", [("train.nope", "1")])
  with pytest.raises(ValueError, match="is a float"):
    study.base_config("smoke", [("train.num_steps", "2.5")])
  with pytest.raises(ValueError, match="unexpected argument"):
    study.parse_overrides(["--seeds=3"])


def test_protocol_check_refuses_a_root_of_another_configuration(tmp_path):
  study.check_protocol(tmp_path, study.base_config("smoke", []))
  study.check_protocol(tmp_path, study.base_config("smoke", []))  # Same: accepted.
  with pytest.raises(SystemExit, match="train.num_steps"):
    study.check_protocol(tmp_path, study.base_config("smoke", [("train.num_steps", "9")]))
  # A root recorded before a config field existed is the same protocol.
  recorded = json.loads((tmp_path / "protocol.json").read_text())
  del recorded["rollout"]["prefill_chunk"]
  (tmp_path / "protocol.json").write_text(json.dumps(recorded))
  study.check_protocol(tmp_path, study.base_config("smoke", []))
  # How the same model is computed is not protocol.
  study.check_protocol(tmp_path, study.base_config("smoke", [("model.attention_block_q", "512")]))


def test_report_of_a_root_without_finished_runs_names_no_seeds(tmp_path):
  config = study.base_config("smoke", [])
  study_report.write_report(tmp_path, config, "grpo", ("python bench/study.py", "the command"))
  text = (tmp_path / "results.md").read_text()
  assert "No run has finished yet; the driver is `python bench/study.py`." in text
  assert "--seeds  " not in text and "No finished run yet." in text


def _trained(out: str) -> list[str]:
  return [line for line in out.splitlines()
          if "trained to RL step" in line or "warm start" in line]


def test_driver_end_to_end_resumes_and_reports(compile_cache, tmp_path, capsys):
  """1 seed x 2 methods on the smoke preset; rerun trains nothing; a cut run resumes."""
  argv = ["--root", str(tmp_path), "--preset", "smoke", "--seeds", "1",
          "--methods", "eppo", "grpo"]
  study.main(argv)
  first = capsys.readouterr().out
  assert len(_trained(first)) == 1 + 2, first
  summary = json.loads((tmp_path / "summary.json").read_text())
  tasks = summary["tasks"]
  for method in ("eppo", "grpo"):
    for seed in (1,):
      evals = [r for r in read_records(tmp_path / f"seed{seed}" / method)
               if r.get("eval_success") is not None]
      assert [r["step"] for r in evals] == [0, 2, 3]
      m = summary["runs"][method][str(seed)]
      assert m["final_success"] == evals[-1]["eval_success"]
      assert m["worst_task_final"] == min(evals[-1][f"task/{t}/eval_success"] for t in tasks)
      # Every method starts from its seed's warm start: the same step-0 eval.
      assert m["start_success"] == summary["runs"]["eppo"][str(seed)]["start_success"]
  d = summary["differences"]["eppo"]["worst_task_final"]
  assert d["n"] == 1 and set(d["per_seed"]) == {"1"}
  assert (tmp_path / "curves.png").stat().st_size > 0
  report = (tmp_path / "results.md").read_text()
  assert "Paired difference eppo − grpo" in report and "| eppo | 1 |" in report

  # Everything finished: the second call trains nothing and rewrites the same report.
  mtime = (tmp_path / "seed1" / "grpo" / "metrics.jsonl").stat().st_mtime_ns
  study.main(argv)
  second = capsys.readouterr().out
  assert not _trained(second) and second.count("finished earlier") == 2, second
  assert (tmp_path / "seed1" / "grpo" / "metrics.jsonl").stat().st_mtime_ns == mtime
  assert json.loads((tmp_path / "summary.json").read_text())["runs"] == summary["runs"]

  # --report-only with --seeds reports those seeds only (here one with no finished run).
  report_only = ["--root", str(tmp_path), "--preset", "smoke", "--report-only"]
  study.main(report_only + ["--seeds", "0"])
  assert "No finished run yet." in capsys.readouterr().out
  assert "| eppo |" not in (tmp_path / "results.md").read_text()
  study.main(report_only)
  assert "| eppo | 1 |" in capsys.readouterr().out
  assert json.loads((tmp_path / "summary.json").read_text())["runs"] == summary["runs"]

  # The archive (records only, trimmed) is a root whose report equals the original's.
  kept = tmp_path / "archive"
  study.main(report_only + ["--archive", str(kept)])
  assert "records of 3 finished runs" in capsys.readouterr().out
  assert not list(kept.rglob("checkpoints")) and (kept / "seed1" / "sft" / "metrics.jsonl").exists()
  # The warm start's loss curve is kept (its records are its SFT steps).
  sft = read_records(kept / "seed1" / "sft")
  assert [r["sft_loss"] for r in sft if r["step"] < 0] == [
      r["sft_loss"] for r in read_records(tmp_path / "seed1" / "sft") if r["step"] < 0] != []
  study.main(["--root", str(kept), "--preset", "smoke", "--report-only"])
  capsys.readouterr()
  archived = json.loads((kept / "summary.json").read_text())
  assert archived["runs"] == summary["runs"] and archived["differences"] == summary["differences"]
  # An archive is reported as its runs were configured, even where the preset has changed since.
  study.main(["--root", str(kept), "--preset", "study", "--report-only"])
  capsys.readouterr()
  assert json.loads((kept / "summary.json").read_text())["runs"] == summary["runs"]
  assert "is an archive" in (kept / "results.md").read_text() and "is an archive" not in report
  size = lambda r: (r / "seed1" / "eppo" / "metrics.jsonl").stat().st_size
  assert size(kept) < size(tmp_path) * 0.6, (size(kept), size(tmp_path))
  last = json.loads((kept / "seed1" / "eppo" / "metrics.jsonl").read_text().splitlines()[-1])
  assert "time/step_s" not in last and "task/sokoban:easy/action_entropy" in last
  assert (kept / "seed1" / "eppo" / "config.json").exists()
  with pytest.raises(SystemExit):  # Archiving a root onto itself would trim its records.
    study.main(report_only + ["--archive", str(tmp_path)])
  assert size(tmp_path) > size(kept) / 0.6

  # A run cut after its step-2 checkpoint resumes there and ends where the whole run ended.
  workdir = tmp_path / "seed1" / "grpo"
  whole = read_records(workdir)
  (workdir / "final_metrics.json").unlink()
  shutil.rmtree(workdir / "checkpoints" / "3")
  study.main(["--root", str(tmp_path), "--preset", "smoke", "--seeds", "1", "--methods", "grpo"])
  third = capsys.readouterr().out
  assert len(_trained(third)) == 1, third
  resumed = read_records(workdir)
  drop = ("time", "time/generation_s", "time/environment_s", "time/update_s", "time/step_s",
          "tokens_per_s")
  strip = lambda rs: [{k: v for k, v in r.items() if k not in drop} for r in rs]
  assert strip(resumed) == strip(whole)


def test_screen_applies_the_declared_rule_to_hand_made_runs(tmp_path):
  """Two seeds of 12 RL steps on tasks a, b: the three numbers and the verdict, by hand."""
  import screen  # pylint: disable=g-import-not-at-top
  root = tmp_path / "screen_x"
  root.mkdir()
  (root / "protocol.json").write_text(json.dumps({"tasks": {"specs": ["a", "b"]},
                                                  "train": {"num_steps": 12}}))
  # (eval of a, b at step 0, at step 12, clip_low, clip_high, entropy of a, b each step).
  seeds = {0: ((0.2, 0.6), (0.5, 0.7), 0.04, 0.02, (1.0, 0.3)),
           1: ((0.4, 0.8), (0.6, 0.8), 0.05, 0.03, (0.8, 0.5))}
  for seed, (start, end, low, high, (h_a, h_b)) in seeds.items():
    run = root / f"seed{seed}" / "grpo"
    run.mkdir(parents=True)
    evals = lambda step, s: {"step": step, "eval_success": sum(s) / 2,
                             **{f"task/{t}/eval_success": x for t, x in zip("ab", s)}}
    records = [evals(0, start)] + [
        {"step": k, "clip_frac_low": low, "clip_frac_high": high, "num_entropy_spikes": 0,
         "task/a/entropy": h_a, "task/b/entropy": h_b} for k in range(1, 13)] + [evals(12, end)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "final_metrics.json").write_text(json.dumps({"step": 12}))
  out = screen.screen(root)
  # Worst task (a) 0.2 -> 0.5 and 0.4 -> 0.6; b (0.7 mean at step 0) is the easier task.
  assert out["gain"] == pytest.approx((0.3 + 0.2) / 2)
  assert out["gains"] == pytest.approx({0: 0.3, 1: 0.2})
  assert out["clipped"] == pytest.approx((0.06 + 0.08) / 2)
  assert (out["easy"], out["hard"]) == ("b", "a")
  assert out["entropy_ratio"] == pytest.approx(0.4 / 0.9)
  assert out["passes"] == {"learns": True, "binds": True, "mismatch": True}
  assert "| screen_x | 2 | +0.250 (yes) | 7.00% (yes) | b |" in screen.table([out])
