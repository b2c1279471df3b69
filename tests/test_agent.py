"""Multi-turn episode collection: the episode loop, loss masks, groups, faults, and a real model."""

import functools
import random
import threading
import time

import jax
import numpy as np
import pytest

import eppo_jax
from eppo_jax import agent, sampling, steps
from eppo_jax import hosts
from eppo_jax import mesh as meshlib
from eppo_jax.envs import FrozenLake, format_action, play, registry
from eppo_jax.models import hf
from eppo_jax.policy import ModelPolicy
from pipeline_util import runs, smoke_tiny_dir  # pylint: disable=unused-import

TASKS = ("sokoban:easy", "frozenlake:easy", "countdown:easy")
SEEDS = (0, 1, 7, 123)
# Room for every expert reply, every turn of an expert episode, and a cache that never cuts it.
LOOP = dict(max_turns=64, max_new_tokens=64, max_slots=1 << 20)


@pytest.fixture(scope="module")
def pretrained(smoke_tiny_dir):
  """The smoke preset's tiny random model and its tokenizer."""
  return hf.load_pretrained(smoke_tiny_dir)


@pytest.fixture(scope="module")
def chat(pretrained):
  """The chat format with the tiny tokenizer's ChatML template; <|im_end|> stops a reply."""
  tok = pretrained.tokenizer
  return agent.ChatFormat(tok, [tok.convert_tokens_to_ids("<|im_end|>")])


@pytest.fixture(scope="module")
def expert_runs(chat):
  """Per task: (expert episodes through the loop, the same games played directly on the env)."""
  out = {}
  for k, spec in enumerate(TASKS):
    instances = [agent.Instance(k, spec, seed) for seed in SEEDS]
    batch = agent.expert_episodes(chat, registry.make, instances, pad_id=0, **LOOP)
    direct = [play(registry.make(spec), seed) for seed in SEEDS]
    out[spec] = (batch, direct)
  return out


@pytest.mark.parametrize("spec", TASKS)
def test_expert_replay_matches_direct_play(expert_runs, spec):
  """Expert actions replayed through the episode loop give the env's own returns and verdicts."""
  batch, direct = expert_runs[spec]
  for b, episode in enumerate(direct):
    assert episode.won, f"{spec} seed {SEEDS[b]}: the expert itself fails"
    assert batch.rewards[b] == pytest.approx(sum(episode.rewards), abs=1e-5)
    assert batch.success[b] == episode.won
    assert batch.turns[b] == len(episode.actions)
    assert batch.invalid_actions[b] == episode.invalid_actions == 0
    assert not batch.failed[b] and not batch.truncated[b]


@pytest.mark.parametrize("spec", TASKS)
def test_loss_mask_covers_exactly_the_replies(expert_runs, chat, spec):
  """Every loss-masked run decodes to one reply + stop token; the rest is template + observation."""
  tok = chat.tokenizer
  stop = tok.decode([chat.stop_token_ids[0]])
  batch, direct = expert_runs[spec]
  for b, episode in enumerate(direct):
    n = int(batch.attention_mask[b].sum())
    assert batch.attention_mask[b, :n].all() and not batch.attention_mask[b, n:].any()
    assert not batch.loss_mask[b, n:].any()
    tokens, loss = batch.tokens[b, :n], batch.loss_mask[b, :n]
    replies = [tok.decode(tokens[s:e]) for s, e in runs(loss)]
    assert replies == [format_action(a) + stop for a in episode.actions]
    assert batch.replies(tok, b) == replies
    # Between replies: the template around each observation, and nothing generated.
    gaps = runs(~loss)
    assert len(gaps) == len(replies) and gaps[0][0] == 0 and runs(loss)[-1][1] == n
    for (s, e), observation in zip(gaps, episode.observations):
      assert observation in tok.decode(tokens[s:e])
    # The whole sequence is the chat template's rendering of the conversation.
    env = registry.make(spec)
    messages = [{"role": "system", "content": env.instructions},
                {"role": "user", "content": episode.observations[0]}]
    for i, action in enumerate(episode.actions):
      messages.append({"role": "assistant", "content": format_action(action)})
      if i + 1 < len(episode.actions):  # The last observation (game over) is never shown.
        messages.append({"role": "user", "content": episode.observations[i + 1]})
    rendered = tok.apply_chat_template(messages, tokenize=False)
    decoded = tok.decode(tokens)
    assert rendered.startswith(decoded) and not rendered[len(decoded):].strip()


def test_group_episodes_share_the_first_observation(chat):
  """The G episodes of an instance start from identical prompt tokens (the instance's reset)."""
  g = 3
  instances = [agent.Instance(k, spec, seed) for k, spec in enumerate(TASKS) for seed in (3, 4)]
  actions = []
  for inst in instances:
    env = registry.make(inst.spec)
    env.reset(inst.seed)
    expert = env.solve()
    # Different replies within a group, so the episodes diverge after the prompt.
    actions += [expert, ["nonsense"] + expert, expert[::-1]]
  policy = agent.ScriptedPolicy(chat, actions, 64)
  batch = agent.collect_episodes(policy, chat, registry.make, instances, g, max_turns=4,
                                 max_new_tokens=64, max_slots=1 << 20)
  np.testing.assert_array_equal(batch.group_ids, np.repeat(np.arange(len(instances)), g))
  np.testing.assert_array_equal(batch.task_ids, np.repeat([i.task_id for i in instances], g))
  prompts = [batch.tokens[b, :np.argmax(batch.loss_mask[b])].tolist() for b in range(len(actions))]
  for i, inst in enumerate(instances):
    group = prompts[i * g:(i + 1) * g]
    assert all(p == group[0] for p in group)
    observation, _ = registry.make(inst.spec).reset(inst.seed)
    assert observation in chat.tokenizer.decode(group[0])
    rows = batch.tokens[i * g:(i + 1) * g]
    assert not (rows == rows[0]).all(), "the episodes of a group never diverged: vacuous check"
  assert len({tuple(p) for p in prompts}) == len(instances)


# ----------------------------------------------------------------------------------------------
# Failing and hanging environments.

FAULT_RATE = 0.1
FAULTY, HANGING = "faultylake_test", "hanginglake_test"  # Registry names of the test envs.


class _FaultyLake(FrozenLake):
  """FrozenLake whose step raises with probability FAULT_RATE, seeded by the instance.

  Registered as FAULTY; `task_name` stays "frozenlake" because it seeds the map.
  """

  def reset(self, seed):
    self.faults = random.Random(f"fault/{seed}")
    return super().reset(seed)

  def step(self, action):
    if self.faults.random() < FAULT_RATE:
      raise RuntimeError("injected environment fault")
    return super().step(action)


_RELEASE = threading.Event()  # Lets the hung step return when the test is over.
HANG_SEED = 5


class _HangingLake(FrozenLake):
  """FrozenLake whose second step on instance HANG_SEED blocks far past the stepper's timeout."""

  def step(self, action):
    if self.seed == HANG_SEED and self._steps == 1:
      _RELEASE.wait(30.0)
    return super().step(action)


def _expert_actions(spec, seeds):
  actions = []
  for seed in seeds:
    env = registry.make(spec)
    env.reset(seed)
    actions.append(env.solve())
  return actions


def _play_scripted(chat, spec, seeds, actions, stepper=None):
  instances = [agent.Instance(0, spec, s) for s in seeds]
  return agent.collect_episodes(agent.ScriptedPolicy(chat, actions, 64), chat, registry.make,
                                instances, 1, stepper=stepper, **LOOP)


def test_failing_env_steps_end_only_their_episodes(chat):
  """Raising steps end their episodes as failed; every other episode is exactly a clean run."""
  registry.register(FAULTY, _FaultyLake, overwrite=True)
  seeds = list(range(24))
  actions = _expert_actions("frozenlake:easy", seeds)
  clean = _play_scripted(chat, "frozenlake:easy", seeds, actions)
  faulty = _play_scripted(chat, f"{FAULTY}:easy", seeds, actions)
  # Which episodes must fail, and at which turn: replay each instance's fault draws.
  expected_turn = {}
  for b, seed in enumerate(seeds):
    draws = random.Random(f"fault/{seed}")
    for turn in range(1, int(clean.turns[b]) + 1):
      if draws.random() < FAULT_RATE:
        expected_turn[b] = turn
        break
  assert 0 < len(expected_turn) < len(seeds), "seeds chosen so that some, not all, fail"
  np.testing.assert_array_equal(np.flatnonzero(faulty.failed), sorted(expected_turn))
  for b in range(len(seeds)):
    if b in expected_turn:
      assert faulty.turns[b] == expected_turn[b]
      continue
    for field in ("rewards", "success", "turns", "invalid_actions", "truncated"):
      assert getattr(faulty, field)[b] == getattr(clean, field)[b], field
    n = int(clean.attention_mask[b].sum())
    assert int(faulty.attention_mask[b].sum()) == n
    np.testing.assert_array_equal(faulty.tokens[b, :n], clean.tokens[b, :n])
    np.testing.assert_array_equal(faulty.loss_mask[b, :n], clean.loss_mask[b, :n])


def test_hanging_env_step_times_out_as_failed(chat):
  """A step that hangs past `timeout_s` ends that episode as failed; the batch goes on."""
  registry.register(HANGING, _HangingLake, overwrite=True)
  seeds = [3, HANG_SEED, 9]
  actions = _expert_actions("frozenlake:easy", seeds)
  assert len(actions[1]) >= 2
  clean = _play_scripted(chat, "frozenlake:easy", seeds, actions)
  stepper = agent.EnvStepper(workers=2, timeout_s=0.5)
  start = time.perf_counter()
  try:
    hung = _play_scripted(chat, f"{HANGING}:easy", seeds, actions, stepper)
  finally:
    elapsed = time.perf_counter() - start
    _RELEASE.set()
  assert elapsed < 10.0
  np.testing.assert_array_equal(hung.failed, [False, True, False])
  assert hung.turns[1] == 2 and not hung.success[1]
  for b in (0, 2):
    assert hung.success[b] and not hung.failed[b]
    assert hung.rewards[b] == clean.rewards[b] and hung.turns[b] == clean.turns[b]


# ----------------------------------------------------------------------------------------------
# A real (tiny, random) model.

MAX_SLOTS = 1024


class _RecordingPolicy:
  """Calls `sampling.rollout` turn by turn on one device and keeps what it returned."""

  def __init__(self, params, config, sampling_cfg, rng):
    self.params, self.config, self.sampling, self.rng = params, config, sampling_cfg, rng
    self.outputs = []

  def __call__(self, chunk, chunk_mask, state, active, agreed=None):
    key = jax.random.fold_in(self.rng, len(self.outputs))
    kwargs = dict(max_len=MAX_SLOTS) if state is None else dict(cache=state)
    out = sampling.rollout(self.params, self.config, chunk, chunk_mask, key, self.sampling,
                           **kwargs)
    self.outputs.append(jax.device_get((out.tokens, out.logprobs, out.mask)))
    assert not np.asarray(out.mask)[~active].any()  # Finished rows generate nothing.
    return out.tokens, out.mask, out.cache, (out.logprobs, out.entropies)


_full_logits = jax.jit(eppo_jax.logits, static_argnums=1)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _teacher_forced(params, config, tokens, mask, temperature):
  return steps.sequence_logprobs(params, config, tokens, mask, temperature)


def _sampling_cfg(chat, **kw):
  return sampling.SamplingConfig(max_new_tokens=8, stop_token_ids=chat.stop_token_ids,
                                 pad_id=chat.tokenizer.pad_token_id, **kw)


def _instances():
  return [agent.Instance(k, spec, 11 + k) for k, spec in enumerate(TASKS)]


def test_model_episodes_are_what_the_cache_saw(pretrained, chat):
  """Teacher-forced log-probs of the recorded conversation equal those the cached rollout gave."""
  temperature = 0.8
  policy = _RecordingPolicy(pretrained.params, pretrained.config,
                            _sampling_cfg(chat, temperature=temperature), jax.random.PRNGKey(3))
  batch = agent.collect_episodes(policy, chat, registry.make, _instances(), 2, max_turns=2,
                                 max_new_tokens=8, max_slots=MAX_SLOTS,
                                 pad_id=chat.tokenizer.pad_token_id)
  assert len(policy.outputs) == 2
  logp, entropy = jax.device_get(_teacher_forced(pretrained.params, pretrained.config,
                                                 batch.tokens, batch.attention_mask, temperature))
  assert np.isfinite(logp).all() and np.isfinite(entropy).all()
  for b in range(len(batch.rewards)):
    generated = np.concatenate([tok[b][m[b]] for tok, _, m in policy.outputs])
    reported = np.concatenate([lp[b][m[b]] for _, lp, m in policy.outputs])
    where = np.flatnonzero(batch.loss_mask[b])
    assert len(where) == len(generated) > 0
    np.testing.assert_array_equal(batch.tokens[b, where], generated)
    np.testing.assert_allclose(logp[b, where - 1], reported, atol=1e-4, rtol=0)
    # The episode records the sampler's numbers aligned with its tokens, zero elsewhere.
    np.testing.assert_array_equal(batch.logprobs[b, where], reported)
    np.testing.assert_allclose(batch.entropies[b, where], entropy[b, where - 1], atol=1e-4)
  assert not batch.logprobs[~batch.loss_mask].any() and not batch.entropies[~batch.loss_mask].any()


def test_model_policy_collects_consistent_greedy_episodes(pretrained, chat):
  """ModelPolicy over all devices: greedy tokens are the teacher-forced argmax; groups agree."""
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY)
  params = hosts.put(pretrained.params, meshlib.shardings(pretrained.params, mesh))
  policy = ModelPolicy(params, pretrained.config, _sampling_cfg(chat, greedy=True), MAX_SLOTS,
                       jax.random.PRNGKey(0), mesh)
  g = 5  # 15 rows over 4 devices (4 each, one filler row): groups straddle devices.
  batch = agent.collect_episodes(policy, chat, registry.make, _instances(), g, max_turns=2,
                                 max_new_tokens=8, max_slots=MAX_SLOTS,
                                 pad_id=chat.tokenizer.pad_token_id)
  assert (batch.turns >= 1).all() and not batch.failed.any()
  # Greedy decoding of one instance gives the same episode on whichever device it ran.
  for b in range(len(batch.rewards)):
    np.testing.assert_array_equal(batch.tokens[b], batch.tokens[b - b % g])
  logits = jax.device_get(_full_logits(pretrained.params, pretrained.config, batch.tokens,
                                       batch.attention_mask))
  logp, _ = jax.device_get(_teacher_forced(pretrained.params, pretrained.config, batch.tokens,
                                           batch.attention_mask, 1.0))
  checked = 0
  for b in range(len(batch.rewards)):
    where = np.flatnonzero(batch.loss_mask[b])
    assert len(where) > 0 and np.isfinite(logp[b, where - 1]).all()
    np.testing.assert_allclose(batch.logprobs[b, where], logp[b, where - 1], atol=1e-4)
    top2 = np.sort(logits[b, where - 1], axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 1e-4  # Near-ties cannot tell cached from uncached math.
    argmax = logits[b, where - 1].argmax(-1)
    np.testing.assert_array_equal(argmax[decided], batch.tokens[b, where][decided])
    checked += decided.sum()
  assert checked >= 0.9 * batch.loss_mask.sum()



@pytest.mark.parametrize("greedy", [True, False])
def test_model_policy_compaction_keeps_replies(pretrained, chat, greedy):
  """Turns after episodes end run on a compacted cache and reply exactly as without compaction:
  sampled episodes too, since each draws from its own stream wherever its row moves."""
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY)
  params = hosts.put(pretrained.params, meshlib.shardings(pretrained.params, mesh))
  cfg = _sampling_cfg(chat, greedy=greedy)
  d = jax.device_count()
  n = 16 * d  # 16 rows per device: room for two quarterings.
  rng = np.random.default_rng(0)
  vocab = pretrained.config.vocab_size
  # Live episodes per turn: all, then a quarter (4 rows per device), then two (1 row per device).
  actives = [np.ones(n, bool), np.arange(n) % 4 == 1, np.isin(np.arange(n), [1, 17])]
  policies = {c: ModelPolicy(params, pretrained.config, cfg, 256, jax.random.PRNGKey(0), mesh,
                             compact=c) for c in (False, True)}
  states = {c: None for c in policies}
  expected_rows = n
  for turn, active in enumerate(actives):
    lengths = rng.integers(3, 20, n)
    chunk, mask = sampling.left_pad(
        [list(rng.integers(5, vocab, k)) if a else [] for k, a in zip(lengths, active)], [32], 0)
    replies = {}
    for c, policy in policies.items():
      reply, reply_mask, states[c], _ = policy(chunk, mask, states[c], active.copy())
      replies[c] = (reply, reply_mask)
    (plain, plain_mask), (packed, packed_mask) = replies[False], replies[True]
    np.testing.assert_array_equal(packed_mask, plain_mask)
    np.testing.assert_array_equal(packed[active], plain[active])
    assert plain_mask[active].any(axis=1).all() and not plain_mask[~active].any()
    # The live rows, in the smallest quarter of the batch that is a multiple of the devices.
    while expected_rows % (4 * d) == 0 and expected_rows // 4 >= active.sum():
      expected_rows //= 4
    assert states[True]["mask"].shape[0] == expected_rows, (turn, states[True]["mask"].shape)
    assert states[False]["mask"].shape[0] == n
  assert expected_rows < n  # The test did compact.


def test_model_policy_prefill_in_pieces_equals_one_prefill(pretrained, chat):
  """prefill_chunk=8 on 32-token chunks (3 pieces of 8, then the turn on the last 8): the same
  greedy replies, log-probs and cache as prefilling each chunk in one call."""
  mesh = meshlib.make_mesh(meshlib.DATA_ONLY)
  params = hosts.put(pretrained.params, meshlib.shardings(pretrained.params, mesh))
  cfg = _sampling_cfg(chat, greedy=True)
  n = jax.device_count()
  rng = np.random.default_rng(1)
  vocab = pretrained.config.vocab_size
  policies = {c: ModelPolicy(params, pretrained.config, cfg, 256, jax.random.PRNGKey(0), mesh,
                             prefill_chunk=c) for c in (0, 8)}
  states = {c: None for c in policies}
  for _ in range(2):
    chunk, mask = sampling.left_pad(
        [list(rng.integers(5, vocab, k)) for k in rng.integers(9, 30, n)], [32], 0)
    out = {c: policy(chunk, mask, states[c], np.ones(n, bool)) for c, policy in policies.items()}
    (whole, whole_mask, states[0], whole_scores), (split, split_mask, states[8], split_scores) = (
        out[0], out[8])
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(split_mask, whole_mask)
    assert whole_mask.any()
    np.testing.assert_allclose(split_scores[0], whole_scores[0], atol=1e-5)
  for key in ("mask", "pos", "index"):
    np.testing.assert_array_equal(np.asarray(states[8][key]), np.asarray(states[0][key]))
  # Keys and values of the written slots; pad slots are never attended and may hold anything.
  written_BxS = np.asarray(states[0]["mask"])
  for key in ("k", "v"):  # [L, B, K, S, H]
    split, whole = (np.asarray(states[c][key]).transpose(1, 3, 0, 2, 4) for c in (8, 0))
    np.testing.assert_allclose(split[written_BxS], whole[written_BxS], atol=1e-5)
