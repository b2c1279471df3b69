"""Multi-turn episode collection on the host: chat template, action parsing, loss masks.

An episode is one conversation, and one token sequence: the prompt (system instructions + first
observation), then turns of (assistant reply, environment observation). The policy sees the
conversation through a KV cache that is extended turn by turn, so it is never re-encoded; what it
saw is recorded token for token, and only the tokens it generated carry loss.

A `Policy` is any callable that continues a batch of conversations by one assistant turn:

    policy(chunk_BxC, chunk_mask_BxC, state, active_B, agreed) -> (reply_BxN, reply_mask_BxN, state)
                                                    or (reply_BxN, reply_mask_BxN, state, scores)

`chunk` holds the new tokens of each conversation (left-padded, mask False on pads and on
inactive rows), `reply_mask` marks the generated tokens up to and including the stop token, and
`state` is whatever the policy carries between turns (the KV cache); it is None on the first turn.
`agreed` holds the numbers every host agreed on before the turn (`Agreed`): a policy that runs one
program over several hosts sizes it from them, never from its own host's rows.
A sampling policy also returns `scores = (logprobs_BxN, entropies_BxN)`, its own numbers for each
reply token, which the episode records (the trainer's `old_logprobs="sampler"` option reads them).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Optional, Sequence

import numpy as np

from eppo_jax import hosts, interrupt
from eppo_jax.episodes import EpisodeBatch, observation_hash
from eppo_jax.envs import registry
from eppo_jax.envs.base import action_span, format_action, parse_action
from eppo_jax.envs.pool import EnvPool
from eppo_jax.envs.process_pool import ProcessEnvPool
from eppo_jax.sampling import left_pad

_SENTINEL = "\u2063EPPO_REPLY\u2063"  # Marks where the reply sits when rendering the template.

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Instance:
  """One task instance; the `G` episodes of a GRPO group share it."""

  task_id: int
  spec: str  # "name:level"
  seed: int


@dataclasses.dataclass(frozen=True)
class Agreed:
  """What every host agreed on before a turn (`collect_episodes` takes one collective a turn): the
  same numbers on every host. The chunk width is agreed too: every host's chunk has that width."""

  rows: int  # The most episodes any host plays.
  live: int  # The most episodes any host still has playing.


Policy = Callable[[np.ndarray, np.ndarray, object, np.ndarray, Agreed], tuple]


def round_up(n: int, multiple: int = 32) -> int:
  """Rounds a length up to a multiple (at least one), so jitted shapes come from a few sizes.

  Multiples rather than `sampling.bucket`'s fixed list: turn chunks and episodes have no natural
  upper bound, and the cache size (`max_slots`) already caps what fits.
  """
  return max(multiple, -(-n // multiple) * multiple)


SYSTEM_PROMPTS = ("instructions", "task_name")


class ChatFormat:
  """Token pieces of a conversation, rendered by the tokenizer's own chat template.

  The template renders only the pieces around each new message; a finished conversation is never
  re-rendered, because some templates rewrite earlier turns (Qwen3's drops their <think> blocks),
  and the update must train on the tokens that were sampled.

  `system_prompt` is "instructions" (the task's full rules and action format: what a pretrained
  model needs) or "task_name" (one line naming the task: a small model trained from scratch cannot
  read rules and learns the format from demonstrations, so long instructions would only multiply
  the tokens of every episode).
  """

  def __init__(self, tokenizer, stop_token_ids: Sequence[int], system_prompt: str = "instructions"):
    if system_prompt not in SYSTEM_PROMPTS:
      raise ValueError(f"system_prompt must be one of {SYSTEM_PROMPTS}, got {system_prompt!r}")
    self.tokenizer = tokenizer
    self.stop_token_ids = tuple(stop_token_ids)
    self.system_prompt = system_prompt
    self._stop_texts = tuple(tokenizer.decode([t]) for t in self.stop_token_ids)
    # Every reply token of every turn is placed by its text (`action_mask`): decode each id once.
    self._token_text = functools.lru_cache(maxsize=None)(
        lambda t: tokenizer.decode([t], skip_special_tokens=True))

  def system(self, env) -> str:
    return env.instructions if self.system_prompt == "instructions" else f"Task: {env.task_name}"

  def _encode(self, text: str) -> list[int]:
    return self.tokenizer(text, add_special_tokens=False)["input_ids"]

  def prompt(self, instructions: str, observation: str) -> list[int]:
    messages = [{"role": "system", "content": instructions},
                {"role": "user", "content": observation}]
    return self._encode(self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False))

  def next_turn(self, observation: str, reply_stopped: bool) -> list[int]:
    """Tokens that close the reply, hold the observation, and open the next assistant turn."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL},
                {"role": "user", "content": observation}]
    text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
    suffix = text.split(_SENTINEL, 1)[1]
    if reply_stopped:  # The generated stop token already closed the reply.
      for stop in self._stop_texts:
        if suffix.startswith(stop):
          suffix = suffix[len(stop):]
          break
    return self._encode(suffix)

  def action_mask(self, reply: Sequence[int]) -> list[bool]:
    """True on the reply tokens that spell its action (what `parse_action` reads), without the
    tags, format and stop tokens around it: where the reply's decision is.

    Each token is placed by its own decoded text, so a token that straddles the action's edge
    counts, and offsets stay consistent for any tokenizer."""
    pieces = [self._token_text(t) for t in reply]
    span = action_span("".join(pieces))
    if span is None:
      return [False] * len(reply)
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.array([len(p) for p in pieces], int)
    return ((starts < span[1]) & (ends > span[0])).tolist()

  def reply_tokens(self, action: str) -> list[int]:
    """A demonstration reply: the formatted action and the stop token."""
    return self._encode(format_action(action)) + [self.stop_token_ids[0]]


ENV_BACKENDS = ("inline", "threads", "processes")


class EnvStepper:
  """How the episode loop calls its environments, one pool per batch of episodes.

  * "inline": one after another in the caller's thread. `timeout_s` is NOT enforced (nothing can
    interrupt the caller's own thread): for trusted, fast games only (the built-in grid games and
    Countdown).
  * "threads": an `envs.EnvPool` of `workers` threads (0: one per env) with the timeout; a hung
    call is abandoned, not killed, and one stuck in C code holding the GIL stalls the process.
  * "processes": an `envs.ProcessEnvPool` of `workers` processes (0: one per CPU core) with the
    timeout; a hung worker is killed and replaced, whatever it is doing. Envs are built in the
    workers from picklable factories (`registry.factory`).

  A reset or step that raises or times out ends that episode as a failure; the rest of the batch
  goes on. Each distinct failure is logged once with its traceback.
  """

  def __init__(self, workers: int = 0, timeout_s: float = 30.0, backend: str | None = None):
    backend = backend or ("threads" if workers else "inline")
    if backend not in ENV_BACKENDS:
      raise ValueError(f"env backend must be one of {ENV_BACKENDS}, got {backend!r}")
    self.backend, self.workers, self.timeout_s = backend, workers, timeout_s
    self._seen: set[str] = set()
    self.seconds = 0.0  # Wall time spent in environment calls, for the trainer's time split.

  def pool(self, specs: Sequence[str], make_env: Callable[[str], object]):
    """A pool holding one new env per spec (`make_env(spec)`), closed by the caller."""
    if self.backend == "processes":
      if make_env is registry.make:
        fns = [registry.factory(spec) for spec in specs]
      else:
        fns = [functools.partial(make_env, spec) for spec in specs]
      return ProcessEnvPool(fns, num_workers=self.workers or None, timeout_s=self.timeout_s)
    envs = [make_env(spec) for spec in specs]
    workers = 0 if self.backend == "inline" else (self.workers or None)
    return EnvPool(envs, num_workers=workers, timeout_s=self.timeout_s)

  def call(self, fn: Callable, *args) -> list:
    """`fn(*args)` (a pool method), timed, with its failures logged once each."""
    start = time.perf_counter()
    results = fn(*args)
    for result in results:
      error = result[-1].get("error") if result[-1].get("failed") else None
      if error is not None and error.splitlines()[-1] not in self._seen:
        self._seen.add(error.splitlines()[-1])
        log.warning("environment failure (episode ends as failed; logged once):\n%s", error)
    self.seconds += time.perf_counter() - start
    return results


class _Playing:
  """The host-side record of `n` episodes played in lock step: each conversation's tokens in
  order, what the next turn shows, and the per-episode outcome so far."""

  def __init__(self, n: int, max_turns: int):
    self.conv = [[] for _ in range(n)]  # Token ids of each conversation, in order.
    self.conv_mask = [[] for _ in range(n)]  # True on generated tokens.
    self.conv_scores = [[] for _ in range(n)]  # (logprob, entropy) per token, (0, 0) off replies.
    self.conv_turn = [[] for _ in range(n)]  # Turn index of each generated token, -1 elsewhere.
    self.conv_action = [[] for _ in range(n)]  # True on generated tokens that spell the action.
    self.pending = [[] for _ in range(n)]  # Tokens each conversation still has to show the policy.
    self.shown = [-1] * n  # observation_hash of the observation the next turn answers.
    self.step_rewards = np.zeros((n, max_turns), np.float32)
    self.step_states = np.full((n, max_turns), -1, np.int64)
    self.rewards, self.turns = np.zeros(n, np.float32), np.zeros(n, np.int32)
    self.invalid = np.zeros(n, np.int32)
    self.success, self.failed = np.zeros(n, bool), np.zeros(n, bool)
    self.truncated, self.active = np.zeros(n, bool), np.ones(n, bool)

  def show(self, b: int, tokens: list[int], observation: str) -> None:
    self.pending[b] = tokens
    self.shown[b] = observation_hash(observation)

  def fail(self, b: int) -> None:
    self.pending[b] = []
    self.failed[b], self.active[b] = True, False

  def record_reply(self, b: int, generated: list[int], scores_2xN: np.ndarray,
                   action_mask: list[bool]) -> None:
    """Appends what the turn showed episode `b` and its reply; the turn is counted."""
    pending = self.pending[b]
    self.conv_action[b] += [False] * len(pending) + action_mask
    self.conv[b] += pending + generated
    self.conv_mask[b] += [False] * len(pending) + [True] * len(generated)
    self.conv_scores[b] += [(0.0, 0.0)] * len(pending) + list(zip(*scores_2xN))
    self.conv_turn[b] += [-1] * len(pending) + [int(self.turns[b])] * len(generated)
    self.step_states[b, self.turns[b]] = self.shown[b]
    self.turns[b] += 1

  def record_step(self, b: int, result, chat: ChatFormat) -> None:
    """The environment's answer to episode `b`'s last reply."""
    observation, reward, done, info = result
    if info.get("failed"):
      self.failed[b], self.active[b] = True, False
      return
    self.rewards[b] += reward
    self.step_rewards[b, self.turns[b] - 1] = reward
    self.invalid[b] += int(info.get("invalid_action", False))
    self.success[b] = bool(info.get("won", False))
    self.truncated[b] = bool(info.get("truncated", False))
    conv, mask = self.conv[b], self.conv_mask[b]
    stopped = bool(conv) and conv[-1] in chat.stop_token_ids and mask[-1]
    if done:
      self.active[b] = False
    else:
      self.show(b, chat.next_turn(observation, stopped), observation)

  def batch(self, episodes: Sequence[tuple[int, Instance]], pad_id: int,
            length_multiple: int) -> EpisodeBatch:
    """The episodes as right-padded arrays of one bucketed width."""
    n, conv = len(episodes), self.conv
    width = round_up(max([1] + [len(c) for c in conv]), length_multiple)
    tokens = np.full((n, width), pad_id, np.int32)
    attention, loss = np.zeros((n, width), bool), np.zeros((n, width), bool)
    sampled = np.zeros((2, n, width), np.float32)
    turn_ids = np.full((n, width), -1, np.int32)
    action = np.zeros((n, width), bool)
    for b in range(n):
      tokens[b, :len(conv[b])] = conv[b]
      turn_ids[b, :len(conv[b])] = self.conv_turn[b]
      attention[b, :len(conv[b])] = True
      loss[b, :len(conv[b])] = self.conv_mask[b]
      action[b, :len(conv[b])] = self.conv_action[b]
      if conv[b]:
        sampled[:, b, :len(conv[b])] = np.asarray(self.conv_scores[b], np.float32).T
    return EpisodeBatch(
        tokens=tokens, attention_mask=attention, loss_mask=loss, logprobs=sampled[0],
        entropies=sampled[1],
        task_ids=np.array([inst.task_id for _, inst in episodes], np.int32),
        group_ids=np.array([g for g, _ in episodes], np.int32),
        rewards=self.rewards, success=self.success, turns=self.turns,
        invalid_actions=self.invalid, failed=self.failed,
        truncated=(self.truncated | self.active) & ~self.success, action_mask=action,
        turn_ids=turn_ids,
        step_rewards=self.step_rewards, step_states=self.step_states)


def collect_episodes(policy: Policy, chat: ChatFormat, make_env: Callable[[str], object],
                     instances: Sequence[Instance], group_size: int, *, max_turns: int,
                     max_new_tokens: int, max_slots: int, stepper: Optional[EnvStepper] = None,
                     pad_id: int = 0, length_multiple: int = 32,
                     stop: Optional[Callable[[], int]] = None) -> EpisodeBatch:
  """Plays `group_size` episodes of every instance in lock step, one policy call per turn.

  `max_slots` is the policy's KV-cache size: every turn writes a chunk and a reply of the batch's
  common (bucketed) width, and episodes are cut (truncated) before the cache would overflow.

  On several hosts every host calls this together with its own instances: the policy's turn is one
  program over all of them. So each decision that changes which program runs or its shapes is
  taken from numbers agreed by all hosts, one small collective at the top of each turn (the most
  episodes, live episodes and chunk tokens on any host): whether another turn runs, the chunk
  width, whether the turn fits the cache (else every host's live episodes are truncated), and the
  policy's batch sizes (`Agreed`). A host whose episodes have all ended plays empty rows until
  every host's have. `stop` (a signal number, 0 for none; `interrupt.pending`) joins that
  collective: once any host's is set, every host raises `interrupt.StopNow` at the same turn.
  """
  stepper = stepper or EnvStepper()
  episodes = [(i, inst) for i, inst in enumerate(instances) for _ in range(group_size)]
  n = len(episodes)
  # The system prompt comes from a local env per task: pool envs may live in other processes.
  prompt_envs = {inst.spec: make_env(inst.spec) for _, inst in episodes}
  systems = {spec: chat.system(env) for spec, env in prompt_envs.items()}
  for env in prompt_envs.values():
    env.close()
  pool = stepper.pool([inst.spec for _, inst in episodes], make_env)
  play = _Playing(n, max_turns)
  resets = stepper.call(pool.reset, [inst.seed for _, inst in episodes])
  for b, (observation, info) in enumerate(resets):
    if info.get("failed"):
      play.fail(b)
    else:
      play.show(b, chat.prompt(systems[episodes[b][1].spec], observation), observation)

  state, slots, active = None, 0, play.active
  for _ in range(max_turns):
    longest = max((len(p) for p, a in zip(play.pending, active) if a), default=1)
    # The turn's one collective: every host decides from the same numbers.
    rows, live, longest, signum = hosts.global_max([n, int(active.sum()), longest,
                                                    stop() if stop else 0])
    if signum:
      pool.close()
      raise interrupt.StopNow(int(signum))
    width = round_up(int(longest), length_multiple)
    if slots + width + max_new_tokens > max_slots:
      break  # The next turn would overflow the cache: live episodes end truncated.
    if not live:
      break
    chunk, chunk_mask = left_pad([p if a else [] for p, a in zip(play.pending, active)],
                                 [width], pad_id)
    reply, reply_mask, state, *scores = policy(chunk, chunk_mask, state, active.copy(),
                                               Agreed(rows=int(rows), live=int(live)))
    reply, reply_mask = np.asarray(reply), np.asarray(reply_mask, bool)
    scores = (np.zeros((2,) + reply.shape, np.float32) if not scores or scores[0] is None
              else np.stack([np.asarray(x, np.float32) for x in scores[0]]))
    slots += width + reply.shape[1]
    stepping = np.flatnonzero(active)
    actions = []
    for b in stepping:
      generated = reply[b][reply_mask[b]].tolist()
      play.record_reply(b, generated, scores[:, b][:, reply_mask[b]], chat.action_mask(generated))
      actions.append(parse_action(chat.tokenizer.decode(generated, skip_special_tokens=True)))
    results = stepper.call(pool.step, actions, stepping) if len(stepping) else []
    for b, result in zip(stepping, results):
      play.record_step(b, result, chat)
  pool.close()  # Episodes still playing (max_turns, or the cache) end truncated.
  return play.batch(episodes, pad_id, length_multiple)


class ScriptedPolicy:
  """Replies with given action strings (the expert's, for demonstrations and tests)."""

  def __init__(self, chat: ChatFormat, actions: Sequence[Sequence[str]], width: int,
               pad_id: int = 0):
    self._chat, self._actions, self._width, self._pad = chat, actions, width, pad_id
    self._turn = 0

  def __call__(self, chunk, chunk_mask, state, active, agreed=None):
    del agreed  # Replies come from the script: nothing runs on devices.
    rows = []
    for b, acts in enumerate(self._actions):
      if active[b] and self._turn < len(acts):
        rows.append(self._chat.reply_tokens(acts[self._turn])[:self._width])
      else:
        rows.append([])
    self._turn += 1
    reply = np.full((len(rows), self._width), self._pad, np.int32)
    mask = np.zeros_like(reply, bool)
    for b, row in enumerate(rows):
      reply[b, :len(row)], mask[b, :len(row)] = row, True
    return reply, mask, state


def expert_transcripts(make_env, instances: Sequence[Instance],
                       stepper: Optional[EnvStepper] = None) -> list[tuple[list, list]]:
  """(observations, actions) of the expert playing each instance until the game ends, through
  the stepper's pool: a failing or hanging env ends its transcript there (no observation at all
  when its reset or `solve` fails) instead of stopping the caller."""
  stepper = stepper or EnvStepper()
  pool = stepper.pool([inst.spec for inst in instances], make_env)
  try:
    resets = stepper.call(pool.reset, [inst.seed for inst in instances])
    plans = pool.call("solve", default=None)
    out = [([], []) for _ in instances]
    live = []
    for b, ((observation, info), plan) in enumerate(zip(resets, plans)):
      if not info.get("failed") and plan is not None:
        out[b][0].append(observation)
        live.append(b)
    turn = 0
    while live := [b for b in live if turn < len(plans[b])]:
      results = stepper.call(pool.step, [plans[b][turn] for b in live], live)
      going = []
      for b, (observation, _, done, info) in zip(live, results):
        if info.get("failed"):
          continue
        out[b][1].append(plans[b][turn])
        out[b][0].append(observation)
        if not done:
          going.append(b)
      live, turn = going, turn + 1
  finally:
    pool.close()
  return out


def expert_episodes(chat: ChatFormat, make_env, instances: Sequence[Instance], *, max_turns: int,
                    max_new_tokens: int, max_slots: int, pad_id: int = 0,
                    stepper: Optional[EnvStepper] = None,
                    stop: Optional[Callable[[], int]] = None) -> EpisodeBatch:
  """Demonstrations: the expert's actions played through the same episode loop as the policy.

  An instance whose env fails comes back with `failed` set; callers drop those. `stop` as in
  `collect_episodes`.
  """
  actions = [acts for _, acts in expert_transcripts(make_env, instances, stepper)]
  policy = ScriptedPolicy(chat, actions, max_new_tokens, pad_id)
  return collect_episodes(policy, chat, make_env, instances, 1, max_turns=max_turns,
                          max_new_tokens=max_new_tokens, max_slots=max_slots, stepper=stepper,
                          pad_id=pad_id, stop=stop)
