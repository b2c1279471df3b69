r"""Export parity: a run's policy played greedily by transformers from its `hf_export/`, against the
project's own greedy evaluation of the same policy, on the same held-out instances.

  python bench/export_parity.py --workdir runs/smollm2 --per-task 8
  python bench/export_parity.py --workdir runs/smollm2 --per-task 2 --show 2   # and the replies

(a) The project: the run's config (its `config.json`) and newest intact checkpoint, set up by
    `train.Trainer` on a scratch copy (nothing in --workdir is written), plays each task's first N
    held-out seeds (`TaskSampler.eval_instances`, what `Trainer.evaluate` plays) with
    `Trainer.play` and the greedy policy: adapters unmerged, one KV cache across the turns.
(b) transformers: `AutoModelForCausalLM` on `<workdir>/hf_export` (adapters merged), float32 on
    the CPU, one episode at a time, turn by turn: the chat rendered with the tokenizer's own
    template (system message as the run's `tasks.system_prompt` asks, each observation a user
    message, each reply an assistant message), `generate` greedy on the whole conversation with
    the run's max_new_tokens and stop tokens, the action parsed from the reply, the env stepped.

Prints per task the success of each side and the fraction of episodes whose action sequences (and
reply tokens) are identical, and the first turn where each differing episode parts. Exits 1 when
any action sequence differs. An episode that the project cut short because its KV cache was full
(`rollout.max_episode_tokens`) differs too: transformers plays up to `rollout.max_turns`. Both
sides compute in float32 unless the run's dtype is bfloat16 (`--dtype` sets the project's;
near-tied greedy choices then may differ). One host only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

import common  # bench/common.py: the script's own folder is on sys.path.


@dataclasses.dataclass
class Played:
  """One episode as a sequence of turns."""

  replies: list  # Generated token ids of each turn, the stop token included.
  actions: list  # What `parse_action` read from each reply (None: no action).
  success: bool


def episodes_by_turn(batch, tokenizer) -> list[Played]:
  """An `EpisodeBatch` as per-turn replies and actions."""
  from eppo_jax.envs import parse_action  # pylint: disable=g-import-not-at-top
  out = []
  for b in range(len(batch.turns)):
    generated = batch.loss_mask[b].astype(bool)
    replies = [batch.tokens[b][generated & (batch.turn_ids[b] == t)].tolist()
               for t in range(int(batch.turns[b]))]
    out.append(Played(replies, [parse_action(tokenizer.decode(r, skip_special_tokens=True))
                                for r in replies], bool(batch.success[b])))
  return out


def project_play(workdir: Path, config, instances) -> tuple[list[Played], int]:
  """(a): the project's greedy evaluation of the run's newest checkpoint -> (episodes, its step)."""
  from eppo_jax import agent, train  # pylint: disable=g-import-not-at-top
  train.use_compilation_cache(config.train.compilation_cache)  # The run's programs, compiled.
  with tempfile.TemporaryDirectory(prefix="export_parity_") as scratch:
    run = common.scratch_run(workdir, config, Path(scratch))
    trainer = train.Trainer(config, run, None)
    try:
      trainer.setup()
      if trainer.resumed is None:
        raise SystemExit(f"no intact checkpoint under {workdir}/checkpoints")
      batch = trainer.play(trainer.policy(trainer.keys["eval"], greedy=True),
                           [agent.Instance(k, trainer.specs[k], s) for k, s in instances], 1)
      return episodes_by_turn(batch, trainer.tokenizer), trainer.step
    finally:
      trainer.close()


def continue_chat(tokenizer, messages: list, rendered: str, reply: list[int], observation: str,
                  stop_ids) -> tuple[list[int], str]:
  """Adds `reply` (an assistant message) and `observation` (a user message) to `messages` ->
  (the tokens that follow the reply, the whole conversation's text).

  `rendered` is the conversation's text before the reply. What follows the reply's content is cut
  from the template's rendering of the whole conversation; a stop token the reply generated is not
  repeated."""
  stopped = bool(reply) and reply[-1] in stop_ids
  content = tokenizer.decode(reply[:-1] if stopped else reply, skip_special_tokens=False)
  messages += [{"role": "assistant", "content": content}, {"role": "user", "content": observation}]
  whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  if not whole.startswith(rendered + content):
    raise ValueError("the chat template renders earlier turns differently once a turn is added: "
                     "the conversation cannot be continued token for token")
  rest = whole[len(rendered + content):]
  if stopped:
    stop = tokenizer.decode(reply[-1:], skip_special_tokens=False)
    if not rest.startswith(stop):
      raise ValueError(f"the template ends an assistant turn with {rest[:20]!r}, not with the "
                       f"stop token {stop!r} the reply generated")
    rest = rest[len(stop):]
  return tokenizer(rest, add_special_tokens=False)["input_ids"], whole


def transformers_play(export_dir: Path, config, instances) -> list[Played]:
  """(b): `generate` on the exported model, turn by turn, one episode at a time."""
  # pylint: disable=g-import-not-at-top
  import torch
  import transformers
  from eppo_jax import train
  from eppo_jax.envs import parse_action, registry
  r = config.rollout
  tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(export_dir,
                                                            dtype=torch.float32).eval()
  stop_ids = train.stop_token_ids(tokenizer)
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
  greedy = transformers.GenerationConfig(max_new_tokens=r.max_new_tokens, do_sample=False,
                                         eos_token_id=list(stop_ids), pad_token_id=pad_id)
  out = []
  for k, seed in instances:
    env = registry.make(config.tasks.specs[k])
    observation, _ = env.reset(seed)
    system = (env.instructions if config.tasks.system_prompt == "instructions"
              else f"Task: {env.task_name}")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": observation}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    played = Played([], [], False)
    for _ in range(r.max_turns):
      with torch.no_grad():
        tokens = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                                dtype=torch.long),
                                generation_config=greedy)[0, len(ids):].tolist()
      stops = [i for i, t in enumerate(tokens) if t in stop_ids]
      reply = tokens[:stops[0] + 1] if stops else tokens
      action = parse_action(tokenizer.decode(reply, skip_special_tokens=True))
      played.replies.append(reply)
      played.actions.append(action)
      observation, _, done, info = env.step(action)
      played.success = bool(info.get("won", False))
      if done:
        break
      more, rendered = continue_chat(tokenizer, messages, rendered, reply, observation, stop_ids)
      ids = ids + reply + more
    env.close()
    out.append(played)
  return out


def first_difference(a: Played, b: Played) -> Optional[int]:
  """The first turn whose replies differ (None: identical episodes)."""
  for t in range(max(len(a.replies), len(b.replies))):
    if t >= len(a.replies) or t >= len(b.replies) or a.replies[t] != b.replies[t]:
      return t
  return None


def compare(workdir, per_task: int, dtype: Optional[str] = None) -> dict:
  """Both sides on each task's first `per_task` held-out seeds -> {spec: summary, "step": the
  checkpoint's RL step, "seconds": (project, transformers) wall times}, where a summary holds
  `project` and `transformers` (lists of `Played`), their success rates, and the fractions of
  episodes with identical actions and identical replies."""
  from eppo_jax.envs.sampler import TaskSampler  # pylint: disable=g-import-not-at-top
  workdir = Path(workdir)
  if not (workdir / "hf_export" / "config.json").exists():
    raise SystemExit(f"{workdir}/hf_export is missing: the run exports it when it finishes "
                     "(config.train.export_hf)")
  config = common.load_run_config(workdir)
  if dtype:
    config.model.dtype = config.model.param_dtype = dtype
  specs = list(config.tasks.specs)
  instances = TaskSampler(specs, seed=config.seed).eval_instances(per_task)
  start = time.perf_counter()
  ours, step = project_play(workdir, config, instances)
  middle = time.perf_counter()
  theirs = transformers_play(workdir / "hf_export", config, instances)
  result = {"step": step, "seconds": (middle - start, time.perf_counter() - middle)}
  for k, spec in enumerate(specs):
    rows = [i for i, (task, _) in enumerate(instances) if task == k]
    a, b = [ours[i] for i in rows], [theirs[i] for i in rows]
    result[spec] = {
        "seeds": [instances[i][1] for i in rows], "project": a, "transformers": b,
        "success_project": float(np.mean([e.success for e in a])),
        "success_transformers": float(np.mean([e.success for e in b])),
        "identical_actions": float(np.mean([x.actions == y.actions for x, y in zip(a, b)])),
        "identical_replies": float(np.mean([x.replies == y.replies for x, y in zip(a, b)])),
    }
  return result


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a finished run (with hf_export/)")
  parser.add_argument("--per-task", type=int, default=8, help="held-out instances per task")
  parser.add_argument("--dtype", default="", help="the project's compute and weight dtype "
                      "(default: the run's); transformers computes in float32")
  parser.add_argument("--show", type=int, default=0,
                      help="print the replies of the first N episodes of each task")
  args = parser.parse_args()
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(1)  # See bench/common.py: on a shared machine 1 thread is the fair figure.
  result = compare(args.workdir, args.per_task, args.dtype or None)
  tokenizer = transformers.AutoTokenizer.from_pretrained(Path(args.workdir) / "hf_export")
  seconds = result.pop("seconds")
  print(f"{args.workdir}: RL step {result.pop('step')}, {args.per_task} held-out instances per "
        f"task, greedy; project {seconds[0]:.0f} s (set-up, compilation and play), transformers "
        f"{seconds[1]:.0f} s")
  print(f"{'task':<20} {'success (project)':>18} {'(transformers)':>15} "
        f"{'identical actions':>18} {'identical replies':>18}")
  differ = False
  for spec, s in result.items():
    print(f"{spec:<20} {s['success_project']:>18.2f} {s['success_transformers']:>15.2f} "
          f"{s['identical_actions']:>18.2f} {s['identical_replies']:>18.2f}")
    differ |= s["identical_actions"] < 1.0
  for spec, s in result.items():
    for i, (seed, a, b) in enumerate(zip(s["seeds"], s["project"], s["transformers"])):
      turn = first_difference(a, b)
      if turn is None and i >= args.show:
        continue
      print(f"\n{spec} seed {seed}: " + ("identical" if turn is None else
                                         f"replies part at turn {turn + 1}"))
      for t in range(max(len(a.replies), len(b.replies))):
        if i >= args.show and t != turn:
          continue
        for side, e in (("project", a), ("transformers", b)):
          if t < len(e.replies):
            text = tokenizer.decode(e.replies[t], skip_special_tokens=False)
            print(f"  turn {t + 1} {side:>12}: {text!r} -> action {e.actions[t]!r}")
          else:
            print(f"  turn {t + 1} {side:>12}: (episode over)")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
