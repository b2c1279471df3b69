"""Tokens/s of the EPPO update (`steps.train_step`) vs. the same PPO-clip update in PyTorch.

  python bench/train_step.py --cores 1                # tiny + ~100M Llama, LoRA + full
  python bench/train_step.py --models tiny --repeats 1  # quick look

One update = what `steps.train_step` does on a rollout batch: a teacher-forced pass for the old
log-probs and entropies (pacing), GRPO advantages, then `--minibatches` forward + backward + AdamW
steps (ppo_epochs = 1), compiled as the trainer compiles it (`programs.jit_update`, one program over a
one-device mesh, the state donated). The PyTorch reference
is `transformers.LlamaForCausalLM` loaded from the same exported weights doing the same work on the
same batch: a no-grad pass for old log-probs and entropies, then per minibatch the PPO-clip
token-mean loss, `loss.backward()`, gradient clipping and `torch.optim.AdamW`. LoRA (rank
`--lora-rank`, every projection) is our `lora.add_lora`; on the PyTorch side a small adapter
wrapper around each `nn.Linear` (only the adapters require gradients).

Batches are random tokens with realistic masks: each row is a prompt (no loss), a response (loss)
and right padding, groups of 4 rows share a task instance, 3 tasks. Throughput counts every
position of the padded batch (B x T tokens) per update. Each (model, mode, side) runs in a fresh
subprocess, so its peak RSS (`getrusage`) is its own; the first call (XLA compile + one update) is
reported apart from the median of the timed calls. PyTorch is timed with 1 thread and with its
default threads, each in its own process, interleaved with ours and repeated `--repeats` times
(see `common.py`); the table gives medians over the repeats and the faster PyTorch setting, which
the ratio uses. The entropy column is the |difference| of the
mean token entropy both sides compute in their old-policy pass: a check that they ran the same
model on the same batch.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

import numpy as np

import common

GROUP = 4  # Rows per GRPO group.
NUM_TASKS = 3
LR = 1e-5

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_batch(b: int, t: int, vocab: int, seed: int = 0) -> dict:
  """Random rollout batch: per row a prompt (no loss), a response (loss), then right padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(10, vocab, (b, t)).astype(np.int32)
  attention = np.zeros((b, t), bool)
  loss = np.zeros((b, t), bool)
  for i in range(b):
    prompt = int(rng.integers(t // 8, t // 2))
    response = int(rng.integers(t // 8, t - prompt + 1))
    attention[i, :prompt + response] = True
    loss[i, prompt:prompt + response] = True
  tokens[~attention] = 0
  groups = np.arange(b, dtype=np.int32) // GROUP
  return dict(tokens=tokens, attention_mask=attention, loss_mask=loss,
              task_ids=(groups % NUM_TASKS).astype(np.int32), group_ids=groups,
              rewards=rng.normal(size=b).astype(np.float32))


def grpo_advantages_np(rewards, group_ids, eps: float = 1e-6):
  """(r - group mean) / (unbiased group std + eps), the library's default GRPO estimator."""
  adv = np.zeros_like(rewards)
  for g in np.unique(group_ids):
    r = rewards[group_ids == g]
    adv[group_ids == g] = (r - r.mean()) / (r.std(ddof=1) + eps)
  return adv


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB.


def summarize(times: list[float], b: int, t: int) -> dict:
  step_s = float(np.median(times[1:]))
  return dict(first_s=times[0], compile_s=max(times[0] - step_s, 0.0), step_s=step_s,
              tokens_per_s=b * t / step_s, peak_rss=peak_rss_bytes())


def trainer_update(model_cfg, trainable, frozen, batch: dict, minibatches: int):
  """`steps.train_step` (EPPO, one PPO epoch) compiled as the trainer compiles it
  (`programs.jit_update`) on a one-device mesh, with `frozen` and the host `batch` placed there.
  -> (step(state, key) -> (state, metrics), state); the state holds copies, since it is donated."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from eppo_jax import hosts, mesh as meshlib, objective, pacing, programs, steps  # noqa: E402
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY, jax.local_devices()[:1])
  pacing_cfg, loss_cfg = objective.method_configs("eppo")
  cfg = steps.StepConfig(model=model_cfg, pacing=pacing_cfg, loss=loss_cfg, num_tasks=NUM_TASKS,
                         num_groups=len(batch["tokens"]) // GROUP, num_minibatches=minibatches,
                         minibatch_sharding=meshlib.minibatch_sharding(mesh))
  tx = programs.make_optimizer(LR, 0, 0.0, 1.0)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable,
                           opt_state=tx.init(trainable), pacing=pacing.init_pacing(NUM_TASKS))
  state_sh, frozen_sh = meshlib.shardings(state, mesh), meshlib.shardings(frozen, mesh)
  update = programs.jit_update(cfg, tx, state_sh, frozen_sh, mesh)
  frozen, batch = hosts.put(frozen, frozen_sh), hosts.put_rows(batch, mesh)

  executable = []

  def compiled(state, key):
    """The program `step` runs (compiled at the first call), e.g. for its memory analysis."""
    if not executable:
      with jax.set_mesh(mesh):  # Traced as the trainer traces it (see `mesh.constrain_rows`).
        executable.append(update.lower(state, frozen, batch, key).compile())
    return executable[0]

  def step(state, key):
    return compiled(state, key)(state, frozen, batch, key)
  step.compiled = compiled
  # Copies: placing an array where it already lies is no copy, and the update deletes what it is
  # given, which would take the caller's params with it.
  return step, hosts.put(jax.tree.map(jnp.copy, state), state_sh)


# ----------------------------------------------------------------------------------------------
# Workers (each in its own process).


def jax_worker(args) -> dict:
  """Times the trainer's update program on one device; returns the summary dict."""
  import jax  # pylint: disable=g-import-not-at-top
  import eppo_jax  # pylint: disable=g-import-not-at-top
  from eppo_jax import lora  # pylint: disable=g-import-not-at-top
  from eppo_jax.models.config import LoraConfig  # pylint: disable=g-import-not-at-top

  pre = eppo_jax.load_pretrained(args.model_dir, with_tokenizer=False)
  model_cfg, params = pre.config, pre.params
  if args.mode == "lora":
    model_cfg, params = lora.add_lora(
        params, model_cfg, LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
        jax.random.PRNGKey(1))
  trainable, frozen = lora.partition(
      params, lora.trainable_mask(params, full_finetune=args.mode == "full"))
  del params, pre
  n_trainable = sum(x.size for x in jax.tree_util.tree_leaves(trainable))
  step, state = trainer_update(model_cfg, trainable, frozen,
                               make_batch(args.batch, args.seq, model_cfg.vocab_size),
                               args.minibatches)
  del trainable, frozen
  key = jax.random.PRNGKey(0)
  times, entropy = [], None
  for i in range(1 + args.steps):
    start = time.perf_counter()
    state, metrics = step(state, jax.random.fold_in(key, i))
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
    if i == 0:  # Entropy of the initial policy on the trained tokens, for the parity check.
      m = jax.device_get(metrics)
      entropy = float((m["entropy_K"] * m["token_count_K"]).sum() / m["token_count_K"].sum())
  out = summarize(times, args.batch, args.seq)
  out.update(trainable=int(n_trainable), entropy=entropy)
  device = jax.local_devices()[0]
  if device.platform != "cpu":
    out["device_peak"] = (device.memory_stats() or {}).get("peak_bytes_in_use")
  return out


def torch_worker(args) -> dict:
  """Times the same update with transformers + torch on the exported weights."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.manual_seed(0)
  threads = common.set_torch_threads(args.threads)
  # Where JAX has an accelerator, so should the reference (a CUDA build of torch is needed).
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
  model.config.use_cache = False
  model.train()
  if args.mode == "lora":
    add_torch_lora(model, args.lora_rank, 2.0 * args.lora_rank)
  model.to(device)
  params = [p for p in model.parameters() if p.requires_grad]
  # Same hyper-parameters as `programs.make_optimizer` (clip by global norm 1, AdamW b2 = 0.99).
  opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
  batch = make_batch(args.batch, args.seq, model.config.vocab_size)
  tokens = torch.from_numpy(batch["tokens"]).long().to(device)
  attention = torch.from_numpy(batch["attention_mask"]).long().to(device)
  loss_mask = torch.from_numpy(batch["loss_mask"][:, 1:]).float().to(device)
  adv = torch.from_numpy(grpo_advantages_np(batch["rewards"], batch["group_ids"]))[:, None]
  adv = adv.to(device)
  mbs = np.array_split(np.arange(args.batch), args.minibatches)

  def logp_entropy(rows):
    logits = model(input_ids=tokens[rows, :-1], attention_mask=attention[rows, :-1]).logits
    logits = logits.float()
    logz = torch.logsumexp(logits, -1)
    logp = torch.gather(logits, -1, tokens[rows, 1:, None]).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy

  def update():
    with torch.no_grad():
      old, ent = zip(*(logp_entropy(rows) for rows in mbs))
    old, ent = torch.cat(old), torch.cat(ent)
    for rows in mbs:
      logp, _ = logp_entropy(rows)
      mask = loss_mask[rows]
      ratio = torch.exp(torch.clamp(logp - old[rows], -20.0, 20.0))
      a = adv[rows]
      pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
      loss = (pg * mask).sum() / mask.sum().clamp(min=1.0)  # Token-mean over the minibatch.
      loss.backward()
      torch.nn.utils.clip_grad_norm_(params, 1.0)
      opt.step()
      opt.zero_grad(set_to_none=True)
    # float() waits for the device's stream, so the timing covers every update queued before it.
    return float((ent * loss_mask).sum() / loss_mask.sum())

  times, entropy = [], None
  for i in range(1 + args.steps):
    start = time.perf_counter()
    e = update()
    times.append(time.perf_counter() - start)
    entropy = e if i == 0 else entropy
  out = summarize(times, args.batch, args.seq)
  out.update(trainable=sum(p.numel() for p in params), entropy=entropy, threads=threads)
  if device == "cuda":
    out["device_peak"] = torch.cuda.max_memory_allocated()
  return out


def add_torch_lora(model, rank: int, alpha: float) -> None:
  """Freezes the model and wraps every projection in `x W + (x A) B * alpha / rank`."""
  import torch  # pylint: disable=g-import-not-at-top

  class LoraLinear(torch.nn.Module):
    def __init__(self, base):
      super().__init__()
      self.base = base
      self.a = torch.nn.Parameter(torch.randn(base.in_features, rank) / base.in_features ** 0.5)
      self.b = torch.nn.Parameter(torch.zeros(rank, base.out_features))
      self.scale = alpha / rank

    def forward(self, x):
      return self.base(x) + (x @ self.a) @ self.b * self.scale

  for p in model.parameters():
    p.requires_grad_(False)
  for layer in model.model.layers:
    for parent in (layer.self_attn, layer.mlp):
      for name in LORA_TARGETS:
        if hasattr(parent, name):
          setattr(parent, name, LoraLinear(getattr(parent, name)))


# ----------------------------------------------------------------------------------------------
# Driver.


def export_model(name: str, out_dir: str) -> int:
  """Random weights of model `name` written as an HF directory; returns the parameter count."""
  import jax  # pylint: disable=g-import-not-at-top
  import eppo_jax  # pylint: disable=g-import-not-at-top
  config = eppo_jax.ModelConfig(**common.MODELS[name], max_position_embeddings=2048)
  eppo_jax.export_hf(eppo_jax.init_params(config, jax.random.PRNGKey(0)), config, out_dir)
  return config.num_params()


def worker(side: str, model_dir: str, mode: str, batch: int, seq: int, args, threads: int = 0):
  """A job for `common.interleaved`: one side's timing in a fresh process."""
  argv = ["--worker", side, "--model-dir", model_dir, "--mode", mode, "--batch", str(batch),
          "--seq", str(seq), "--steps", str(args.steps), "--minibatches", str(args.minibatches),
          "--lora-rank", str(args.lora_rank), "--threads", str(threads)]
  return lambda: common.run_worker(__file__, argv)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cores", type=int, default=0,
                      help="cores for both sides (0 = all this process may use)")
  parser.add_argument("--models", default="tiny,100m", help="comma list of tiny, 100m")
  parser.add_argument("--modes", default="lora,full", help="comma list of lora, full")
  parser.add_argument("--tiny-shape", default="16x256", help="batch x sequence for tiny")
  parser.add_argument("--100m-shape", dest="big_shape", default="4x64",
                      help="batch x sequence for 100m")
  parser.add_argument("--steps", type=int, default=2, help="timed updates after the first")
  parser.add_argument("--minibatches", type=int, default=2)
  parser.add_argument("--lora-rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3,
                      help="fresh processes per side and setting (medians are reported)")
  parser.add_argument("--skip-torch", action="store_true", help="time only our side")
  # Internal: run one side in this process and print a RESULT line.
  parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
  parser.add_argument("--model-dir", help=argparse.SUPPRESS)
  parser.add_argument("--mode", default="lora", help=argparse.SUPPRESS)
  parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()

  if args.worker:
    common.emit((jax_worker if args.worker == "jax" else torch_worker)(args))
    return

  cores = common.use_cores(args.cores)  # Before jax starts its thread pool; workers inherit it.
  default_threads = common.torch_default_threads()
  settings = [] if args.skip_torch else common.peer_thread_settings(default_threads)
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; torch {torch.__version__} at "
        f"{' and '.join(common.setting_name(n, default_threads) for n in settings) or '-'}; "
        f"{cores} cores for both; ppo_epochs 1, {args.minibatches} minibatches, float32; "
        f"medians of {args.repeats} interleaved runs per side")
  head = (f"{'model':>5} {'mode':>4} {'B x T':>8} {'trainable':>9} | {'compile s':>9} "
          f"{'step s':>7} {'tok/s':>8} {'RSS GB':>6} | {'torch s @1':>10} {'@default':>9} "
          f"{'tok/s':>8} {'RSS GB':>6} | {'ratio':>6} {'|dH|':>7}  faster torch setting")
  print(head)
  print("-" * len(head))
  shapes = {"tiny": args.tiny_shape, "100m": args.big_shape}
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.models.split(","):
      model_dir = os.path.join(tmp, name)
      export_model(name, model_dir)
      b, t = (int(x) for x in shapes[name].split("x"))
      if b % GROUP or b % args.minibatches:
        raise SystemExit(f"batch {b} must be a multiple of {GROUP} and of --minibatches")
      for mode in args.modes.split(","):
        jobs = {"ours": worker("jax", model_dir, mode, b, t, args)}
        jobs.update({n: worker("torch", model_dir, mode, b, t, args, n) for n in settings})
        runs = common.interleaved(jobs, args.repeats)
        ours = runs["ours"]
        row = (f"{name:>5} {mode:>4} {f'{b}x{t}':>8} {ours[0]['trainable'] / 1e6:8.2f}M | "
               f"{common.median(ours, 'compile_s'):9.1f} {common.median(ours, 'step_s'):7.3f} "
               f"{b * t / common.median(ours, 'step_s'):8.0f} "
               f"{max(r['peak_rss'] for r in ours) / 1e9:6.2f} | ")
        if not settings:
          row += f"{'-':>10} {'-':>9} {'-':>8} {'-':>6} | {'-':>6} {'-':>7}"
        else:
          step_s = {n: common.median(runs[n], "step_s") for n in settings}
          best = common.fastest(step_s)
          ref = runs[best]
          cells = [f"{step_s[n]:.3f}" if n in step_s else "-" for n in (1, 0)]
          row += (f"{cells[0]:>10} {cells[1]:>9} {b * t / step_s[best]:8.0f} "
                  f"{max(r['peak_rss'] for r in ref) / 1e9:6.2f} | "
                  f"{step_s[best] / common.median(ours, 'step_s'):5.2f}x "
                  f"{abs(ours[0]['entropy'] - ref[0]['entropy']):7.1e}  "
                  f"{common.setting_name(best, default_threads)}")
        device_peak = ours[0].get("device_peak")
        if device_peak:
          row += f"  device peak: ours {device_peak / 1e9:.2f} GB"
          if settings and ref[0].get("device_peak"):
            row += f", torch {ref[0]['device_peak'] / 1e9:.2f} GB"
        print(row, flush=True)
  print("ratio = our tokens/s / PyTorch's at its faster thread setting (>1: ours faster); step "
        "times are medians over the repeats. compile s = first call - median step. RSS = peak "
        "resident memory of that side's processes.")


if __name__ == "__main__":
  main()
