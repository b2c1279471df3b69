"""One whole RL step (generation + reward + update) of eppo_jax vs. TRL's `GRPOTrainer` on CPU.

  pip install trl -c <(pip freeze | grep -E '^(torch|transformers)==')   # keeps our torch
  python bench/rl_step.py --cores 1              # tiny model, 8 prompts x G=4 x 32 tokens
  python bench/rl_step.py --cores 1 --model 100m --new-tokens 128
  python bench/rl_step.py --prompts 16 --new-tokens 64 --steps 5 --repeats 1

Both sides do the same work each step, on the same weights (`--model tiny`: the tiny default
Llama, built with `tiny.build_tiny_model`; `--model 100m`: the ~125M Llama shape of
`train_step.py`; both with a locally trained tokenizer and random weights exported by `export_hf`):
B single-turn Countdown prompts (chat template, the tiny config's one-line system prompt), G
sampled completions of each (temperature 1, at most N new tokens, stop at `<|im_end|>`), the
environment's verdict on each completion as the reward, GRPO advantages, and one policy update of
`--minibatches` optimizer steps over the B x G completions (full fine-tuning, AdamW, clip 1.0, no
KL). Our side: `sampling.rollout` -> host rewards -> `steps.train_step`, each jitted over a
data-parallel mesh as the trainer runs them (the update
re-scores old log-probs, paces and computes the advantages; the LM head runs at the completion's
positions only, `StepConfig.loss_tokens_per_row`, as in the trainer). TRL: `GRPOTrainer` with
`num_generations=G`, `per_device_train_batch_size = B x G / minibatches`,
`steps_per_generation = minibatches`, so each generation is followed by `minibatches` optimizer
steps, as ours. The prompts come in the same order on both sides.

Steps are timed after `--warmup` steps (our first one includes XLA compilation, reported apart).
Each side runs in its own fresh process on the same cores (`--cores`); TRL is timed with 1 thread
and with PyTorch's default threads, interleaved with ours and repeated `--repeats` times, and the
ratio uses the faster TRL setting (see `common.py`). Reported: medians over the repeats of each
process's mean timed step, split into generate / reward / update. Throughput counts the completion
tokens actually generated. `--old-logprobs` picks where our update takes the old-policy log-probs
from (`StepConfig.old_logprobs`: "recompute", a teacher-forced pass, or "sampler", the rollout's
own numbers); with an eppo_jax that has no such field the update always recomputes them.
`--share-prompt on` (the trainer's default, `optim.share_prompt`) runs each group's prompt once in
our update instead of once per completion (`StepConfig.shared_prefix`); TRL runs it per completion.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import numpy as np

import common

TASK = "countdown:easy"
LR = 1e-5


def check_trl():
  """The installed trl module, or exit with the install command."""
  try:
    import trl  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise SystemExit("bench/rl_step.py needs TRL: pip install trl -c <(pip freeze | grep -E "
                     "'^(torch|transformers)==')   # the constraint keeps the installed torch") from None
  return trl


def env_reward(task: str, seed: int, completion: str) -> float:
  """The environment's reward for one single-turn reply (1 solved, 0 wrong, penalty if invalid)."""
  from eppo_jax.envs import registry  # pylint: disable=g-import-not-at-top
  env = registry.make(task)
  env.reset(seed)
  _, reward, _, _ = env.step_text(completion)
  env.close()
  return reward


def build_model(name: str, out_dir: str) -> str:
  """Model `name` as an HF directory with the tiny default's tokenizer (trained locally).

  tiny: the default config's sizes (configs/multitask.py). 100m: train_step.py's ~125M Llama
  shape; its 32000-row vocabulary is wider than the tokenizer, as in real checkpoints whose
  embedding is padded, so ids past the tokenizer decode to nothing (both sides alike).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import eppo_jax  # pylint: disable=g-import-not-at-top
  from eppo_jax import train  # pylint: disable=g-import-not-at-top
  from eppo_jax.models import tiny  # pylint: disable=g-import-not-at-top
  # The trainer's own tokenizer corpus, so the tokenizer is the one a real run would use.
  corpus = train.tokenizer_corpus([TASK])
  spec = tiny.TinySpec(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=4,
                       num_heads=4, num_kv_heads=2)
  if name == "tiny":
    return str(tiny.build_tiny_model(out_dir, corpus, spec))
  if os.path.isfile(os.path.join(name, "config.json")):  # A converted or downloaded model.
    return name
  if name != "100m":
    raise SystemExit(f"unknown --model {name!r} (tiny, 100m)")
  tokenizer = tiny.train_tokenizer(corpus, spec.vocab_size)
  config = eppo_jax.ModelConfig(**common.MODELS["100m"], max_position_embeddings=2048)
  if len(tokenizer) > config.vocab_size:
    raise ValueError(f"tokenizer of {len(tokenizer)} ids > the model's {config.vocab_size} rows")
  eppo_jax.export_hf(eppo_jax.init_params(config, jax.random.PRNGKey(0)), config, out_dir,
                     tokenizer)
  return out_dir


def make_prompts(tokenizer, count: int):
  """(prompt texts, seeds): chat-templated Countdown instances, seeds 0..count-1."""
  from eppo_jax.envs import registry  # pylint: disable=g-import-not-at-top
  texts = []
  for seed in range(count):
    env = registry.make(TASK)
    observation, _ = env.reset(seed)
    messages = [{"role": "system", "content": f"Task: {env.task_name}"},
                {"role": "user", "content": observation}]
    texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False))
  return texts, list(range(count))


# ----------------------------------------------------------------------------------------------
# Our side.


class OurStep:
  """rollout -> rewards -> train_step, with the library's pieces, as `train.py` wires them."""

  def __init__(self, model_dir: str, args):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import eppo_jax  # pylint: disable=g-import-not-at-top
    from eppo_jax import hosts, lora, objective, pacing, programs, sampling, steps  # noqa: E402
    from eppo_jax import mesh as meshlib  # pylint: disable=g-import-not-at-top
    self.jax, self.hosts, self.programs, self.sampling, self.args = (jax, hosts, programs,
                                                                     sampling, args)
    self.mesh = mesh = meshlib.make_mesh(meshlib.DATA_ONLY)
    pre = eppo_jax.load_pretrained(model_dir)
    self.tokenizer = pre.tokenizer
    model = pre.config.replace(**common.tiny_model_options(pre.config))
    trainable, frozen = lora.partition(pre.params,
                                       lora.trainable_mask(pre.params, full_finetune=True))
    samp = sampling.SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0,
                                   stop_token_ids=(pre.tokenizer.eos_token_id,),
                                   pad_id=pre.tokenizer.pad_token_id)

    extra, self.old_logprobs = old_logprobs_choice(steps.StepConfig, args.old_logprobs)
    if "loss_tokens_per_row" in {f.name for f in dataclasses.fields(steps.StepConfig)}:
      # As the trainer sets it: the LM head runs at the completion's positions only.
      extra["loss_tokens_per_row"] = -(-args.new_tokens // 32) * 32
    from_sampler = self.old_logprobs == "sampler"

    def sample(trainable, frozen, tokens, mask, rng):
      # Only what the update reads leaves the device; XLA drops the unused outputs (KV cache).
      out = sampling.rollout(lora.combine(trainable, frozen), model, tokens, mask, rng, samp)
      return (out.tokens, out.mask) + ((out.logprobs, out.entropies) if from_sampler else ())

    pacing_cfg, loss_cfg = objective.method_configs("grpo")  # Fixed clip 0.2, as TRL's epsilon.
    self.cfg = steps.StepConfig(model=model, pacing=pacing_cfg, loss=loss_cfg, num_tasks=1,
                                num_groups=args.prompts, temperature=1.0,
                                num_minibatches=args.minibatches, group_size=args.group,
                                minibatch_sharding=meshlib.minibatch_sharding(mesh), **extra)
    self.tx = tx = programs.make_optimizer(LR, 0, 0.0, 1.0)
    state = steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable,
                             opt_state=tx.init(trainable), pacing=pacing.init_pacing(1))
    self.state_sh, self.frozen_sh = meshlib.shardings(state, mesh), meshlib.shardings(frozen, mesh)
    self.state, self.frozen = hosts.put(state, self.state_sh), hosts.put(frozen, self.frozen_sh)
    rows = meshlib.batch_sharding(mesh)
    self.sample = jax.jit(sample, in_shardings=(None, None, rows, rows, meshlib.replicated(mesh)))
    self.updates, self.steps_lib = {}, steps
    # As the trainer (`optim.share_prompt`): each group's prompt runs once in the update, where
    # the minibatches hold whole groups.
    self.share_prompt = args.share_prompt == "on" and not args.prompts % args.minibatches
    self.shared = set()  # The shared prefix lengths used.
    self.key = jax.random.PRNGKey(0)

  def update_fn(self, shared: int):
    """The jitted update for a batch whose groups share their first `shared` tokens."""
    if shared not in self.updates:
      self.updates[shared] = self.programs.jit_update(self.cfg, self.tx, self.state_sh,
                                                      self.frozen_sh, self.mesh, shared)
    return self.updates[shared]

  def encode(self, texts) -> list[list[int]]:
    """Prompt token ids; the chat template already holds every special token."""
    return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

  def step(self, i: int, prompt_ids, seeds, width: int) -> dict:
    """One RL step on B prompts; returns timings and the number of generated tokens."""
    jax, hosts, g = self.jax, self.hosts, self.args.group
    start = time.perf_counter()
    rows = [p for p in prompt_ids for _ in range(g)]  # Group-major: prompt b -> rows b*G..b*G+G-1.
    prompt_BxP, prompt_mask_BxP = self.sampling.left_pad(rows, [width], self.tokenizer.pad_token_id)
    with jax.set_mesh(self.mesh):
      out = self.sample(self.state.trainable, self.frozen, prompt_BxP, prompt_mask_BxP,
                        jax.random.fold_in(self.key, 2 * i))
    tokens_BxN, mask_BxN, *scores = hosts.fetch(out)
    generated = time.perf_counter()
    texts = self.tokenizer.batch_decode([t[m] for t, m in zip(tokens_BxN, mask_BxN)],
                                        skip_special_tokens=True)
    rewards = np.array([env_reward(TASK, s, c) for s, c in zip(np.repeat(seeds, g), texts)],
                       np.float32)
    rewarded = time.perf_counter()
    batch = dict(tokens=np.concatenate([prompt_BxP, tokens_BxN], 1),
                 attention_mask=np.concatenate([prompt_mask_BxP, mask_BxN], 1),
                 loss_mask=np.concatenate([np.zeros_like(prompt_mask_BxP), mask_BxN], 1),
                 task_ids=np.zeros(len(rows), np.int32),
                 group_ids=np.arange(len(rows), dtype=np.int32) // g, rewards=rewards)
    if scores:  # The sampler's log-probs and entropies, aligned with tokens (0 on the prompt).
      zeros_BxP = np.zeros(prompt_BxP.shape, np.float32)
      batch.update({k: np.concatenate([zeros_BxP, x_BxN], 1)
                    for k, x_BxN in zip(("logprobs", "entropies"), scores)})
    shared = 0
    if self.share_prompt:
      # Every step's prompts have one padded width W, so this is one value (W - 1) unrounded.
      shared = self.steps_lib.shared_prefix_length(batch["tokens"], batch["attention_mask"],
                                               batch["loss_mask"], g, multiple=1)
    self.shared.add(shared)
    with jax.set_mesh(self.mesh):
      self.state, metrics = self.update_fn(shared)(self.state, self.frozen,
                                                   hosts.put_rows(batch, self.mesh),
                                                   jax.random.fold_in(self.key, 2 * i + 1))
    jax.block_until_ready((self.state, metrics))
    end = time.perf_counter()
    return dict(total=end - start, generate=generated - start, reward=rewarded - generated,
                update=end - rewarded, tokens=int(mask_BxN.sum()),
                reward_mean=float(rewards.mean()))


def old_logprobs_choice(step_config_cls, wanted: str) -> tuple[dict, str]:
  """(StepConfig kwargs, choice used): passes `old_logprobs` where this eppo_jax has the field."""
  if "old_logprobs" in {f.name for f in dataclasses.fields(step_config_cls)}:
    return {"old_logprobs": wanted}, wanted
  if wanted != "recompute":
    raise SystemExit(f"--old-logprobs {wanted}: this eppo_jax's StepConfig has no old_logprobs "
                     "field (its update always recomputes them)")
  return {}, "recompute (no StepConfig.old_logprobs field in this eppo_jax)"


def prompt_width(ids) -> int:
  """One padded width for every step's prompts, so the rollout compiles once.

  A multiple of 8 over the longest prompt: TRL pads each batch to its own longest prompt, and a
  coarser bucket would hand our update more (padding) positions than TRL's.
  """
  return -(-max(len(x) for x in ids) // 8) * 8


def ours_worker(args) -> dict:
  """Our side in this process: step records (first = warm-up) and the old-log-prob choice."""
  import jax  # pylint: disable=g-import-not-at-top
  ours = OurStep(args.model_dir, args)
  texts, seeds = make_prompts(ours.tokenizer, args.prompts * (args.warmup + args.steps))
  ids = ours.encode(texts)
  width, b = prompt_width(ids), args.prompts
  records = [ours.step(s, ids[s * b:(s + 1) * b], seeds[s * b:(s + 1) * b], width)
             for s in range(args.warmup + args.steps)]
  lengths = [len(x) for x in ids]
  return dict(records=records, old_logprobs=ours.old_logprobs, shared=sorted(ours.shared),
              jax=jax.__version__,
              platform=jax.devices()[0].platform, prompt_lengths=[min(lengths), max(lengths)],
              width=width)


# ----------------------------------------------------------------------------------------------
# TRL's side.


def run_trl(model_dir, texts, seeds, args, tmp):
  """Times `GRPOTrainer.train()` per RL step with a callback; returns step records."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from datasets import Dataset  # pylint: disable=g-import-not-at-top
  from trl import GRPOConfig, GRPOTrainer  # pylint: disable=g-import-not-at-top

  torch.manual_seed(0)
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  generated = []  # (completion tokens, mean reward) per call: one call per generation batch.

  def countdown_reward(completions, seed, completion_ids, **_):
    start = time.perf_counter()
    rewards = [env_reward(TASK, s, c) for s, c in zip(seed, completions)]
    generated.append((sum(len(c) for c in completion_ids), float(np.mean(rewards)),
                      time.perf_counter() - start))
    return rewards

  class Clock(transformers.TrainerCallback):
    def __init__(self):
      self.marks = []

    def on_train_begin(self, *_, **__):
      self.marks.append(time.perf_counter())

    def on_step_end(self, *_, **__):
      self.marks.append(time.perf_counter())

  m = args.minibatches
  config = GRPOConfig(
      output_dir=os.path.join(tmp, "trl"), use_cpu=True, bf16=False, fp16=False, seed=0,
      # One generation of B x G completions, then `m` optimizer steps over it (= ours).
      per_device_train_batch_size=args.prompts * args.group // m, steps_per_generation=m,
      gradient_accumulation_steps=1, num_generations=args.group, num_iterations=1,
      max_steps=m * (args.warmup + args.steps), shuffle_dataset=False,
      max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
      use_vllm=False, beta=0.0, epsilon=0.2, loss_type="dapo",  # dapo = global token-mean.
      learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, adam_beta2=0.99,
      weight_decay=0.0,
      # Ours does not recompute activations in the backward pass; TRL's default would.
      gradient_checkpointing=False,
      report_to="none", save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True)
  dataset = Dataset.from_dict({"prompt": texts, "seed": seeds})
  class TimedGRPOTrainer(GRPOTrainer):
    """Records the wall time of each generation, for the split of TRL's step."""

    def _generate(self, *a, **kw):
      start = time.perf_counter()
      out = super()._generate(*a, **kw)
      generate_s.append(time.perf_counter() - start)
      return out

  generate_s = []
  clock = Clock()
  trainer = TimedGRPOTrainer(model=model, reward_funcs=countdown_reward, args=config,
                             train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
  trainer.train()
  marks = clock.marks
  records = []
  for s in range(args.warmup + args.steps):  # RL step s = trainer steps s*m .. s*m + m - 1.
    total = marks[(s + 1) * m] - marks[s * m]
    tokens, reward_mean, reward_s = generated[s]
    records.append(dict(total=total, tokens=tokens, reward_mean=reward_mean, generate=generate_s[s],
                        reward=reward_s, update=total - generate_s[s] - reward_s))
  return records


def trl_worker(args) -> dict:
  """TRL's side in this process at `--threads` (0 = PyTorch's default): step records."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  trl = check_trl()
  threads = common.set_torch_threads(args.threads)
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  texts, seeds = make_prompts(tokenizer, args.prompts * (args.warmup + args.steps))
  with tempfile.TemporaryDirectory() as tmp:
    records = run_trl(args.model_dir, texts, seeds, args, tmp)
  return dict(records=records, threads=threads, torch=torch.__version__,
              transformers=transformers.__version__, trl=trl.__version__)


# ----------------------------------------------------------------------------------------------
# Driver.

SPLIT = ("total", "generate", "reward", "update", "tokens", "reward_mean")


def summarize(run: dict, warmup: int) -> dict:
  """One process's means over its timed steps (after the warm-up), and its first step."""
  timed = run["records"][warmup:]
  out = {k: float(np.mean([r[k] for r in timed])) for k in SPLIT}
  out["first"] = run["records"][0]["total"]
  return out


def worker_argv(side: str, model_dir: str, args, threads: int = 0) -> list[str]:
  return ["--worker", side, "--model-dir", model_dir, "--threads", str(threads),
          "--prompts", str(args.prompts), "--group", str(args.group),
          "--new-tokens", str(args.new_tokens), "--minibatches", str(args.minibatches),
          "--warmup", str(args.warmup), "--steps", str(args.steps),
          "--old-logprobs", args.old_logprobs, "--share-prompt", args.share_prompt]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cores", type=int, default=0,
                      help="cores for both sides (0 = all this process may use)")
  parser.add_argument("--model", default="tiny",
                      help="tiny: the default config's model; 100m: a ~125M Llama; or an HF model "
                      "directory, e.g. models/smollm2-135m-instruct")
  parser.add_argument("--prompts", type=int, default=8, help="B prompts per step")
  parser.add_argument("--group", type=int, default=4, help="G completions per prompt")
  parser.add_argument("--new-tokens", type=int, default=32, help="N, max completion tokens")
  parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per RL step")
  parser.add_argument("--old-logprobs", default="recompute", choices=("recompute", "sampler"),
                      help="where our update takes the old-policy log-probs from")
  parser.add_argument("--share-prompt", default="on", choices=("on", "off"),
                      help="our update runs each group's prompt once (optim.share_prompt)")
  parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
  parser.add_argument("--steps", type=int, default=3, help="timed steps")
  parser.add_argument("--repeats", type=int, default=3,
                      help="fresh processes per side and setting (medians are reported)")
  parser.add_argument("--goal", type=float, default=2.0, help="target ratio of steps/s")
  # Internal: run one side in this process and print a RESULT line.
  parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
  parser.add_argument("--model-dir", help=argparse.SUPPRESS)
  parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if (args.prompts * args.group) % args.minibatches:
    raise SystemExit("--prompts x --group must be divisible by --minibatches")
  # TRL runs on the CPU (use_cpu): so do we. Set here so the workers inherit it.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.worker:
    common.emit((ours_worker if args.worker == "ours" else trl_worker)(args))
    return

  cores = common.use_cores(args.cores)  # Before jax is imported; the workers inherit the mask.
  check_trl()
  default_threads = common.torch_default_threads()
  settings = common.peer_thread_settings(default_threads)
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = build_model(args.model, os.path.join(tmp, "model"))
    jobs = {"ours": lambda: common.run_worker(__file__, worker_argv("ours", model_dir, args))}
    jobs.update({n: (lambda n=n: common.run_worker(__file__, worker_argv("trl", model_dir, args,
                                                                          n)))
                 for n in settings})
    print(f"{cores} cores for both sides; TRL at "
          f"{' and '.join(common.setting_name(n, default_threads) for n in settings)}; "
          f"model {args.model}; medians of {args.repeats} interleaved runs per side", flush=True)
    runs = common.interleaved(jobs, args.repeats)

  info, peer = runs["ours"][0], runs[settings[0]][0]
  print(f"jax {info['jax']} on {info['platform']}; torch {peer['torch']}, transformers "
        f"{peer['transformers']}, trl {peer['trl']}")
  print(f"{TASK}: B={args.prompts} prompts x G={args.group}, N={args.new_tokens} new tokens, "
        f"prompts of {info['prompt_lengths'][0]}-{info['prompt_lengths'][1]} tokens (ours padded "
        f"to {info['width']}), {args.minibatches} optimizer steps per RL step, {args.warmup} "
        f"warm-up + {args.steps} timed steps")
  print(f"our old log-probs: {info['old_logprobs']}; prompt tokens run once per group in our "
        f"update: {info.get('shared', [0])}")
  rows = {"eppo_jax": [summarize(r, args.warmup) for r in runs["ours"]]}
  for n in settings:
    rows[f"TRL @ {common.setting_name(n, default_threads)}"] = [
        summarize(r, args.warmup) for r in runs[n]]
  print(f"\n{'':>26} {'step s':>7} {'(range)':>11} {'steps/s':>8} {'gen tok/step':>12} "
        f"{'gen tok/s':>9} {'reward':>7}  split (generate / reward / update s)")
  for name, summaries in rows.items():
    step_s = common.median(summaries, "total")
    print(f"{name:>26} {step_s:7.2f} {common.spread(summaries, 'total'):>11} {1 / step_s:8.3f} "
          f"{common.median(summaries, 'tokens'):12.0f} "
          f"{common.median(summaries, 'tokens') / step_s:9.0f} "
          f"{common.median(summaries, 'reward_mean'):7.3f}  "
          f"{common.median(summaries, 'generate'):.2f} / "
          f"{common.median(summaries, 'reward'):.2f} / {common.median(summaries, 'update'):.2f}")
  trl_s = {n: common.median([summarize(r, args.warmup) for r in runs[n]], "total")
           for n in settings}
  best = common.fastest(trl_s)
  ours_s = common.median(rows["eppo_jax"], "total")
  ratio = trl_s[best] / ours_s
  print(f"\nfirst step (ours: XLA compile + step), median: ours "
        f"{common.median(rows['eppo_jax'], 'first'):.1f} s, TRL "
        f"{np.median([summarize(r, args.warmup)['first'] for r in runs[best]]):.1f} s")
  print(f"faster TRL setting: {common.setting_name(best, default_threads)}")
  print(f"ratio (our steps/s / TRL's at its faster setting): {ratio:.2f}x  (goal >= "
        f"{args.goal:.1f}x: {'met' if ratio >= args.goal else 'NOT met'})")


if __name__ == "__main__":
  main()
