"""Token in, token out: the update trains on exactly the tokens the sampler was shown and produced.

For the chat formats of Qwen2.5, Llama 3 and Qwen3 (tiny local tokenizers with each family's special
tokens and a template of its structure), a scripted sampler plays multi-turn episodes through
`agent.collect_episodes`. Each episode row must be the chunks the sampler saw and the replies it
emitted, in order, with loss on the replies only. Qwen3's template drops the reasoning of earlier
assistant turns, so re-rendering a finished conversation gives other tokens than were sampled: the
episode must keep them.
"""

import dataclasses

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from eppo_jax import agent
from eppo_jax.envs import parse_action, registry

# Every template writes its text from Jinja expressions; `-` trims only the layout between tags.
QWEN25_TEMPLATE = r"""
{%- if messages[0]['role'] != 'system' -%}
  {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

LLAMA3_TEMPLATE = r"""
{{- bos_token -}}
{%- for m in messages -%}
  {{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim
      + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

# Reasoning survives only in assistant turns after the last user message; earlier turns keep
# their answer alone.
QWEN3_TEMPLATE = r"""
{%- if messages[0]['role'] == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}
    {{- '<|im_start|>user\n' + m['content'] + '<|im_end|>\n' -}}
  {%- elif m['role'] == 'assistant' -%}
    {%- set answer = m['content'] -%}
    {%- set thought = '' -%}
    {%- if '</think>' in answer -%}
      {%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set answer = answer.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_user -%}
      {{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + answer
          + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
"""

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>")


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family's tokens, template, and its format written out by hand (the reference)."""

  specials: tuple[str, ...]
  template: str
  eos: str  # What ends an assistant turn; the sampler's stop token.
  stops: tuple[str, ...]  # The stop tokens of the family's generation config.
  pad: str
  bos: str | None = None  # Prepended by the tokenizer's post-processor, as the hub's Llama 3 does.
  think: bool = False  # Replies open with a <think> block (added, non-special tokens).

  def prompt_text(self, system: str, observation: str) -> str:
    if self.bos:
      return (f"{self.bos}{_llama3_turn('system', system)}{_llama3_turn('user', observation)}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n")
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{observation}"
            "<|im_end|>\n<|im_start|>assistant\n")

  def gap_text(self, observation: str, reply_stopped: bool) -> str:
    """What follows a reply: its end-of-turn unless sampled, the observation, the next header."""
    close = "" if reply_stopped else self.eos
    if self.bos:
      return (f"{close}{_llama3_turn('user', observation)}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n")
    return f"{close}\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


def _llama3_turn(role: str, content: str) -> str:
  return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"


FAMILIES = {
    "qwen2.5": Family(QWEN_SPECIALS, QWEN25_TEMPLATE, "<|im_end|>",
                      ("<|im_end|>", "<|endoftext|>"), "<|endoftext|>"),
    "llama3": Family(LLAMA3_SPECIALS, LLAMA3_TEMPLATE, "<|eot_id|>",
                     ("<|eot_id|>", "<|end_of_text|>"), "<|finetune_right_pad_id|>",
                     bos="<|begin_of_text|>"),
    "qwen3": Family(QWEN_SPECIALS, QWEN3_TEMPLATE, "<|im_end|>",
                    ("<|im_end|>", "<|endoftext|>"), "<|endoftext|>", think=True),
}

# Two games of different lengths in one batch: sokoban seed 1 is won on the 4th move, frozenlake
# seed 0 is still going when the turn budget ends.
INSTANCES = (agent.Instance(0, "frozenlake:easy", 0), agent.Instance(1, "sokoban:easy", 1))
TURNS = 4
WIDTH = 40  # The sampler's reply width, which is also max_new_tokens.
# How each turn's reply ends, per episode: "stop" (the stop token, then pads), "junk" (the stop
# token, then non-pad tokens outside the reply mask), "cut" (the token budget ran out first).
ENDINGS = (("stop", "junk", "cut", "stop"), ("cut", "stop", "junk", "stop"))
FILLER = " and the ice ahead looks thin, so I keep to the safe tiles by the wall" * 3


def _tokenizer(family: Family):
  """A byte-level BPE tokenizer with the family's special tokens and chat template."""
  corpus = [registry.make(inst.spec).instructions for inst in INSTANCES]
  corpus += ["<think>\nThe goal lies down, so I step down.\n</think>\n\n<action>down</action>",
             "I move left. <action>left</action>", FILLER]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(family.specials),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus, trainer=trainer)
  if family.think:
    tok.add_tokens(["<think>", "</think>"])
  if family.bos:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{family.bos} $A", special_tokens=[(family.bos, tok.token_to_id(family.bos))])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos,
                                 pad_token=family.pad, unk_token=None)
  fast.chat_template = family.template
  return fast


def _encode(tok, text: str) -> list[int]:
  return tok(text, add_special_tokens=False)["input_ids"]


def _reply_text(family: Family, action: str, ending: str) -> str:
  thought = f"<think>\nThe goal lies {action}, so I step {action}.\n</think>\n\n"
  answer = f"I move {action}. <action>{action}</action>"
  if ending == "cut":  # The action comes first, so the game still gets it.
    return (thought if family.think else "") + answer + FILLER
  return (thought if family.think else "") + answer


class ScriptedSampler:
  """A Policy replying with fixed token rows; it records each chunk it is shown."""

  def __init__(self, replies, pad_id: int):
    self.replies = replies  # [B][turn] -> (tokens [WIDTH], mask [WIDTH], logprobs [WIDTH])
    self.pad_id = pad_id
    self.seen = [[] for _ in replies]
    self.turn = 0

  def __call__(self, chunk, chunk_mask, state, active, agreed=None):
    b_size = len(self.replies)
    tokens = np.full((b_size, WIDTH), self.pad_id, np.int32)
    mask = np.zeros((b_size, WIDTH), bool)
    logprobs = np.full((b_size, WIDTH), 7.0, np.float32)  # Any leak off the replies shows as 7.
    for b in np.flatnonzero(active):
      self.seen[b].append(chunk[b][chunk_mask[b].astype(bool)].tolist())
      tokens[b], mask[b], logprobs[b] = self.replies[b][self.turn]
    self.turn += 1
    return tokens, mask, state, (logprobs, -logprobs)


def _script(tok, family: Family, stop_id: int, endings):
  """Per episode, the sampler's reply rows: the expert's actions, ended as `endings` says."""
  replies = []
  for b, inst in enumerate(INSTANCES):
    env = registry.make(inst.spec)
    env.reset(inst.seed)
    acts = env.solve()[:TURNS]
    rows = []
    for t, (action, ending) in enumerate(zip(acts, endings[b])):
      ids = _encode(tok, _reply_text(family, action, ending))
      if ending == "cut":
        assert len(ids) > WIDTH, "the cut reply fits the budget: nothing is cut"
        ids = ids[:WIDTH]
      else:
        ids = ids + [stop_id]
        assert len(ids) < WIDTH - 2, "the reply fills the budget: no room for pads or junk"
      row = np.full(WIDTH, tok.convert_tokens_to_ids(family.pad), np.int32)
      if ending == "junk":
        row[:] = _encode(tok, FILLER)[:WIDTH]
      row[:len(ids)] = ids
      mask = np.arange(WIDTH) < len(ids)
      logprobs = np.where(mask, -(1 + np.arange(WIDTH) + 100 * t + 1000 * b) / 4096, 7.0)
      rows.append((row, mask, logprobs.astype(np.float32)))
    replies.append(rows)
  return replies


def _observations(tok, inst, replies) -> list[str]:
  """The env's observations for the replies, played directly (the parse the loop uses)."""
  env = registry.make(inst.spec)
  out = [env.reset(inst.seed)[0]]
  for row, mask, _ in replies:
    out.append(env.step(parse_action(tok.decode(row[mask].tolist(),
                                                skip_special_tokens=True)))[0])
  return out


def _collect(family: Family, endings=ENDINGS):
  tok = _tokenizer(family)
  chat = agent.ChatFormat(tok, [tok.convert_tokens_to_ids(s) for s in family.stops])
  replies = _script(tok, family, chat.stop_token_ids[0], endings)
  sampler = ScriptedSampler(replies, tok.pad_token_id)
  batch = agent.collect_episodes(sampler, chat, registry.make, INSTANCES, 1, max_turns=TURNS,
                                 max_new_tokens=WIDTH, max_slots=1 << 16,
                                 pad_id=tok.pad_token_id)
  return tok, chat, replies, sampler, batch


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_episode_tokens_are_the_sampled_tokens(name):
  """Loss tokens = the sampled replies; the rest = the chat format's own observation turns."""
  family = FAMILIES[name]
  tok, chat, replies, sampler, batch = _collect(family)
  np.testing.assert_array_equal(batch.turns, [TURNS, TURNS])
  np.testing.assert_array_equal(batch.success, [False, True])  # The game lengths differ.
  for b, inst in enumerate(INSTANCES):
    n = int(batch.attention_mask[b].sum())
    tokens, loss = batch.tokens[b, :n], batch.loss_mask[b, :n]
    sampled = [row[mask].tolist() for row, mask, _ in replies[b]]
    # (a) Loss tokens: the sampled replies, turn by turn, stop tokens where the sampler put them.
    assert tokens[loss].tolist() == sum(sampled, [])
    assert [s[-1] == chat.stop_token_ids[0] for s in sampled] == [
        e != "cut" for e in ENDINGS[b]]
    sampled_logprobs = np.concatenate([lp[m] for _, m, lp in replies[b]])
    np.testing.assert_array_equal(batch.logprobs[b, :n][loss], sampled_logprobs)
    np.testing.assert_array_equal(batch.entropies[b, :n][loss], -sampled_logprobs)
    assert not batch.logprobs[b, :n][~loss].any() and not batch.loss_mask[b, n:].any()
    # (b) Between the replies: the family's format around each observation, written by hand.
    observations = _observations(tok, inst, replies[b])
    system = registry.make(inst.spec).instructions
    gaps = [_encode(tok, family.prompt_text(system, observations[0]))]
    for t in range(1, TURNS):
      gaps.append(_encode(tok, family.gap_text(observations[t], ENDINGS[b][t - 1] != "cut")))
    assert gaps[0] == chat.prompt(system, observations[0])
    assert sampler.seen[b] == gaps  # What the sampler was shown, chunk by chunk.
    expected = sum((g + s for g, s in zip(gaps, sampled)), [])
    expected_loss = sum(([False] * len(g) + [True] * len(s) for g, s in zip(gaps, sampled)), [])
    assert tokens.tolist() == expected
    assert loss.tolist() == expected_loss
    if family.bos:  # Exactly one BOS: the template's, not the tokenizer's on top of it.
      assert tokens.tolist().count(tok.bos_token_id) == 1 and tokens[0] == tok.bos_token_id


def _rerender(tok, system: str, observations, replies) -> list[int]:
  """What a trainer re-rendering the finished conversation with the template would train on."""
  messages = [{"role": "system", "content": system},
              {"role": "user", "content": observations[0]}]
  for t, (row, mask, _) in enumerate(replies):
    messages.append({"role": "assistant",
                     "content": tok.decode(row[mask].tolist(), skip_special_tokens=True)})
    if t + 1 < len(replies):
      messages.append({"role": "user", "content": observations[t + 1]})
  return _encode(tok, tok.apply_chat_template(messages, tokenize=False))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_rerendering_changes_only_qwen3_episodes(name):
  """With every reply stopped, a re-render reproduces Qwen2.5 and Llama 3 episodes token for
  token, but not Qwen3's: its template drops earlier reasoning, which the episode keeps."""
  family = FAMILIES[name]
  tok, _, replies, _, batch = _collect(family, endings=(("stop",) * TURNS,) * 2)
  think = tok.convert_tokens_to_ids("<think>") if family.think else None
  for b, inst in enumerate(INSTANCES):
    n = int(batch.attention_mask[b].sum())
    episode = batch.tokens[b, :n].tolist()
    observations = _observations(tok, inst, replies[b])
    rerendered = _rerender(tok, registry.make(inst.spec).instructions, observations, replies[b])
    if not family.think:
      # The template closes the last turn with a newline the sampler never saw.
      assert rerendered[:n] == episode and not tok.decode(rerendered[n:]).strip()
      continue
    assert rerendered[:n] != episode
    first_reply = int(np.argmax(batch.loss_mask[b]))
    assert episode[first_reply] == think, "the episode lost the first turn's reasoning"
    assert episode.count(think) == TURNS and rerendered.count(think) == 1
    # The difference is exactly the earlier turns' reasoning, nothing else.
    text = tok.decode(episode)
    for row, mask, _ in replies[b][:-1]:
      reply = tok.decode(row[mask].tolist())
      text = text.replace(reply, reply.split("</think>\n\n", 1)[1], 1)
    assert tok.decode(rerendered).rstrip("\n") == text


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_action_mask_marks_the_tokens_that_spell_the_action(name):
  """Per reply, the action-masked tokens are the shortest run of reply tokens whose text holds
  the parsed action; the episode's action mask is those runs at the loss tokens, nothing else."""
  tok, chat, replies, _, batch = _collect(FAMILIES[name])
  for b in range(len(INSTANCES)):
    expected = []
    for row, mask, _ in replies[b]:
      sampled = row[mask].tolist()
      action = parse_action(tok.decode(sampled, skip_special_tokens=True))
      marked = np.flatnonzero(chat.action_mask(sampled))
      first, last = marked.min(), marked.max() + 1
      assert (np.diff(marked) == 1).all()
      assert action in tok.decode(sampled[first:last])
      assert action not in tok.decode(sampled[first + 1:last])
      assert action not in tok.decode(sampled[first:last - 1])
      expected += chat.action_mask(sampled)
    assert batch.action_mask[b][batch.loss_mask[b]].tolist() == expected
    assert not (batch.action_mask[b] & ~batch.loss_mask[b]).any()


def test_action_mask_is_empty_without_an_action():
  """A reply with no `<action>` block, or an empty one, marks nothing."""
  tok = _tokenizer(FAMILIES["qwen2.5"])
  chat = agent.ChatFormat(tok, [tok.convert_tokens_to_ids("<|im_end|>")])
  for text in ("I move down.", "<action>  </action>", ""):
    assert not any(chat.action_mask(_encode(tok, text)))
