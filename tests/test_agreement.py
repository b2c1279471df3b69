"""The episode loop's decisions come from every host's numbers, one collective a turn.

One process plays one host of a pod: `hosts.global_max` is replaced by the maximum of this
host's numbers and another host's, given turn by turn, so the tests can say what the other host
holds and check what this host then does (the multi-process runs are in test_pod.py).
"""

import signal
import sys

import jax
import numpy as np
import pytest

from eppo_jax import agent, hosts, interrupt, sampling
from eppo_jax import mesh as meshlib
from eppo_jax.envs import registry
from eppo_jax.models import hf
from eppo_jax.policy import ModelPolicy
from pipeline_util import ROOT, smoke_tiny_dir  # pylint: disable=unused-import

sys.path.insert(0, str(ROOT / "bench"))
import pod  # pylint: disable=g-import-not-at-top,wrong-import-position

NEW = 8  # Reply tokens per turn.


class OtherHost:
  """`hosts.global_max` against one simulated other host: its [episodes, live episodes, longest
  chunk, stop signal] for each turn (then all zero; a shorter list: the rest zero), and a record
  of every call."""

  def __init__(self, turns):
    self.turns, self.calls = list(turns), []

  def __call__(self, values):
    values = np.asarray(values, np.int64)
    other = self.turns[len(self.calls)] if len(self.calls) < len(self.turns) else []
    self.calls.append(values.copy())
    return np.maximum(values, np.pad(other, (0, len(values) - len(other))))


class Recorder:
  """A policy that replies "<action>1</action>" to live rows and records what it was given."""

  def __init__(self, chat):
    self.chat, self.seen = chat, []

  def __call__(self, chunk, chunk_mask, state, active, agreed=None):
    self.seen.append((chunk.shape, active.copy(), agreed))
    reply = np.zeros((len(active), NEW), np.int32)
    mask = np.zeros_like(reply, bool)
    tokens = self.chat.reply_tokens("1")[:NEW]
    reply[active, :len(tokens)], mask[active, :len(tokens)] = tokens, True
    return reply, mask, state


@pytest.fixture(scope="module")
def chat(smoke_tiny_dir):
  tok = hf.load_pretrained(smoke_tiny_dir).tokenizer
  return agent.ChatFormat(tok, [tok.convert_tokens_to_ids("<|im_end|>")])


def _play(chat, policy, seeds, max_slots=1 << 20, max_turns=4, stop=None):
  instances = [agent.Instance(0, "paced:easy", s) for s in seeds]
  return agent.collect_episodes(policy, chat, registry.make, instances, 1, max_turns=max_turns,
                                max_new_tokens=NEW, max_slots=max_slots, stop=stop)


def test_turns_continue_while_another_host_plays(chat, monkeypatch):
  """This host's episodes end after 1 turn, the other host's after 3: this host plays 3 turns
  (two with no live row), with the other host's sizes, and its episodes are those of a run
  alone."""
  alone = _play(chat, Recorder(chat), [0, 4])  # 1 + seed % 4 = 1 turn each.
  other = OtherHost([[5, 5, 40], [5, 3, 20], [5, 2, 20], [5, 0, 1]])
  monkeypatch.setattr(hosts, "global_max", other)
  policy = Recorder(chat)
  batch = _play(chat, policy, [0, 4])
  assert len(policy.seen) == 3 and len(other.calls) == 4  # The 4th turn: no host has live rows.
  assert [agreed for _, _, agreed in policy.seen] == [agent.Agreed(5, 5), agent.Agreed(5, 3),
                                                      agent.Agreed(5, 2)]
  assert [active.tolist() for _, active, _ in policy.seen] == [[True, True], [False, False],
                                                               [False, False]]
  # The chunk width is the widest host's (rounded up to 32), never narrower than this host's.
  own = [int(c[2]) for c in other.calls]
  assert [shape[1] for shape, _, _ in policy.seen] == [
      agent.round_up(max(o, t[2])) for o, t in zip(own, other.turns)][:3]
  for field in ("tokens", "loss_mask", "turns", "rewards", "truncated"):
    np.testing.assert_array_equal(getattr(batch, field), getattr(alone, field))


def test_a_stop_on_another_host_ends_play_here_at_the_same_turn(chat, monkeypatch):
  """The other host received SIGTERM during turn 1: its signal comes with turn 2's collective,
  and this host stops there too (the policy is not called again), with the other's signal."""
  other = OtherHost([[2, 2, 1, 0], [2, 2, 1, signal.SIGTERM]])
  monkeypatch.setattr(hosts, "global_max", other)
  policy = Recorder(chat)
  with pytest.raises(interrupt.StopNow) as stopped:
    _play(chat, policy, seeds=[3, 3], stop=lambda: 0)
  assert stopped.value.signum == signal.SIGTERM
  assert len(policy.seen) == 1 and len(other.calls) == 2


def test_cache_budget_is_the_widest_hosts(chat, monkeypatch):
  """The other host's second chunk is too wide for the cache: this host's live episodes are
  truncated before that turn, though its own chunk would fit."""
  first, second = _chunk_widths(chat)
  max_slots = first + NEW + second + NEW  # Exactly room for this host's second turn.
  alone = _play(chat, Recorder(chat), [3], max_slots=max_slots)
  assert alone.turns[0] == 2 and alone.truncated[0]  # Alone, the second turn fits; a third not.
  monkeypatch.setattr(hosts, "global_max", OtherHost([[1, 1, 1], [1, 1, second + 1]]))
  policy = Recorder(chat)
  batch = _play(chat, policy, [3], max_slots=max_slots)
  assert len(policy.seen) == 1
  assert batch.turns[0] == 1 and batch.truncated[0]


def _chunk_widths(chat) -> tuple[int, int]:
  """The rounded widths of the first two chunks of a paced episode answered "1"."""
  env = registry.make("paced:easy")
  observation, _ = env.reset(3)
  first = chat.prompt(chat.system(env), observation)
  observation, *_ = env.step("1")
  return agent.round_up(len(first)), agent.round_up(len(chat.next_turn(observation, True)))


def test_a_host_without_episodes_takes_part(chat, monkeypatch):
  """A host with no episode of its own (fewer instances than hosts) runs every turn the other
  host runs, with empty rows, and returns an empty batch."""
  other = OtherHost([[2, 2, 40], [2, 1, 20], [2, 0, 1]])
  monkeypatch.setattr(hosts, "global_max", other)
  policy = Recorder(chat)
  batch = _play(chat, policy, [])
  assert len(policy.seen) == 2 and all(shape[0] == 0 for shape, _, _ in policy.seen)
  assert batch.tokens.shape[0] == 0


# ------------------------------------------------------------------------------------------------
# ModelPolicy.


@pytest.fixture(scope="module")
def pretrained(smoke_tiny_dir):
  return hf.load_pretrained(smoke_tiny_dir)


def _policy(pretrained, chat, max_slots, compact=True):
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY)
  params = hosts.put(pretrained.params, meshlib.shardings(pretrained.params, mesh))
  cfg = sampling.SamplingConfig(max_new_tokens=NEW, greedy=True,
                                stop_token_ids=chat.stop_token_ids,
                                pad_id=chat.tokenizer.pad_token_id)
  return ModelPolicy(params, pretrained.config, cfg, max_slots, jax.random.PRNGKey(0), mesh,
                     compact=compact)


def test_model_policy_refuses_a_turn_that_overflows(pretrained, chat):
  """A turn whose chunk and reply do not fit the cache raises before it runs (no clamping)."""
  policy = _policy(pretrained, chat, max_slots=64)
  n = jax.device_count()
  chunk, mask = np.ones((n, 32), np.int32), np.ones((n, 32), bool)
  reply, _, state, _ = policy(chunk, mask, None, np.ones(n, bool))  # 40 of 64 slots.
  assert reply.shape == (n, NEW)
  with pytest.raises(ValueError, match="does not fit the 64-slot cache"):
    policy(chunk, mask, state, np.ones(n, bool))
  with pytest.raises(ValueError, match="does not fit"):
    policy(np.ones((n, 64), np.int32), np.ones((n, 64), bool), None, np.ones(n, bool))


def test_model_policy_episodes_end_before_the_cache_is_full(pretrained, chat):
  """With a small cache, collect_episodes truncates the episodes instead of overflowing it."""
  first, _ = _chunk_widths(chat)
  max_slots = first + NEW + 16  # One turn fits; a second (at least 32 + NEW) does not.
  batch = _play(chat, _policy(pretrained, chat, max_slots), [3] * jax.device_count(),
                max_slots=max_slots)
  assert (batch.turns == 1).all() and batch.truncated.all()


def test_compaction_waits_for_the_host_with_most_live_rows(pretrained, chat):
  """Compaction sizes follow the most live rows on any host (`Agreed.live`): with one live row
  here but 5 elsewhere, 16 rows per device shrink to a quarter, not a sixteenth."""
  d = jax.device_count()
  n = 16 * d
  policy = _policy(pretrained, chat, max_slots=256)
  rng = np.random.default_rng(0)
  state = None
  for turn, (active, live) in enumerate([(np.ones(n, bool), n),
                                         (np.arange(n) == 3, 4 * d + 1),
                                         (np.arange(n) == 3, 4 * d),
                                         (np.arange(n) == 3, 1)]):
    chunk, mask = sampling.left_pad([list(rng.integers(5, 50, 9)) if a else [] for a in active],
                                    [32], 0)
    _, reply_mask, state, _ = policy(chunk, mask, state, active, agent.Agreed(n, live))
    assert reply_mask[active].any(axis=1).all() and not reply_mask[~active].any()
    expected = [n, n, n // 4, n // 16][turn]  # 4d + 1 live rows do not fit a quarter (4d).
    assert state["mask"].shape[0] == expected, (turn, state["mask"].shape)
