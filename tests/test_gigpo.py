"""GiGPO advantages against a reference written from the paper's equations, and the per-turn
records that the episode loop keeps for them."""

import collections
import hashlib
import statistics

import numpy as np
import pytest

from eppo_jax import agent, config_check, gigpo, objective
from eppo_jax.episodes import EpisodeBatch, observation_hash, training_rewards
from eppo_jax.envs import play, registry
from eppo_jax.models import hf
from pipeline_util import runs, smoke_config, smoke_tiny_dir  # pylint: disable=unused-import

EPS = 1e-6
MAX_TURNS = 5

# Hand-built episode groups: (group, failed, [(observation text, reward) per turn]).
EPISODES = [
    # Group 0: states shared across episodes, and B revisited within episode 0.
    (0, False, [("A", 0.0), ("B", -0.1), ("B", 0.0), ("C", 1.0)]),
    (0, False, [("A", 0.0), ("C", 0.0), ("D", 0.5)]),
    (0, False, [("A", -0.1), ("B", 0.0), ("D", 0.0)]),
    # Group 1: no state in common, not even the first.
    (1, False, [("P", 1.0), ("Q", 0.0)]),
    (1, False, [("R", 0.0)]),
    (1, False, [("S", 0.2), ("T", 0.6)]),
    # Group 2: the texts of group 0 (which must not mix with it) and a failed episode whose
    # returns, were they counted, would move every mean.
    (2, False, [("A", 0.0), ("B", 1.0)]),
    (2, False, [("A", 0.0), ("C", 0.0)]),
    (2, True, [("A", 5.0), ("B", -3.0)]),
    (2, False, [("B", 0.3), ("A", 0.1), ("E", 0.0)]),
    # Group 3: one healthy episode left, so nothing to compare with.
    (3, False, [("A", 1.0), ("B", 0.0)]),
    (3, True, [("A", 0.0)]),
]


def reference(episodes, gamma, omega, step_normalize):
  """A per turn of each episode, straight from the equations, with dicts keyed by the text."""
  def relative(values, normalize):
    if len(values) < 2 or len(set(values)) == 1:
      return [0.0] * len(values)
    mean, std = sum(values) / len(values), statistics.stdev(values)
    return [(v - mean) / (std + EPS) if normalize else v - mean for v in values]

  out = [[0.0] * len(turns) for _, _, turns in episodes]
  for group in {g for g, _, _ in episodes}:
    members = [i for i, (g, failed, _) in enumerate(episodes) if g == group and not failed]
    if len(members) < 2:
      continue
    returns = [sum(r for _, r in episodes[i][2]) for i in members]
    episode_adv = dict(zip(members, relative(returns, True)))
    by_state = collections.defaultdict(list)  # text -> [(episode, turn, discounted return)]
    for i in members:
      turns = episodes[i][2]
      for t, (text, _) in enumerate(turns):
        ret = sum(gamma**(k - t) * turns[k][1] for k in range(t, len(turns)))
        by_state[text].append((i, t, ret))
    for entries in by_state.values():
      for (i, t, _), a in zip(entries, relative([ret for _, _, ret in entries], step_normalize)):
        out[i][t] = episode_adv[i] + omega * a
  return out


def build_batch(episodes, seed=0):
  """An EpisodeBatch laid out as the episode loop does: observation tokens, then reply tokens
  (some replies empty), and a padded tail whose turn_ids are 0 as after a gather over hosts."""
  rng = np.random.default_rng(seed)
  rows = []
  for _, _, turns in episodes:
    loss, turn_ids = [], []
    for t in range(len(turns)):
      shown, replied = int(rng.integers(1, 4)), int(rng.integers(0, 4)) if t else 2
      loss += [False] * shown + [True] * replied
      turn_ids += [-1] * shown + [t] * replied
    rows.append((loss, turn_ids))
  width = max(len(loss) for loss, _ in rows) + 3
  n = len(episodes)
  loss_mask, turn_ids = np.zeros((n, width), bool), np.zeros((n, width), np.int32)
  step_rewards = np.zeros((n, MAX_TURNS), np.float32)
  step_states = np.full((n, MAX_TURNS), -1, np.int64)
  for b, ((loss, ids), (_, _, turns)) in enumerate(zip(rows, episodes)):
    loss_mask[b, :len(loss)], turn_ids[b, :len(ids)] = loss, ids
    for t, (text, reward) in enumerate(turns):
      step_rewards[b, t], step_states[b, t] = reward, observation_hash(text)
  return EpisodeBatch(
      tokens=np.zeros((n, width), np.int32), attention_mask=np.ones((n, width), bool),
      loss_mask=loss_mask, logprobs=np.zeros((n, width), np.float32),
      entropies=np.zeros((n, width), np.float32), task_ids=np.zeros(n, np.int32),
      group_ids=np.array([g for g, _, _ in episodes], np.int32),
      rewards=np.array([sum(r for _, r in turns) for _, _, turns in episodes], np.float32),
      success=np.zeros(n, bool), turns=np.array([len(t) for _, _, t in episodes], np.int32),
      invalid_actions=np.zeros(n, np.int32),
      failed=np.array([f for _, f, _ in episodes], bool), truncated=np.zeros(n, bool),
      turn_ids=turn_ids, step_rewards=step_rewards, step_states=step_states)


def expected_tokens(batch, per_turn):
  """The reference's turn advantages on each loss token of its turn, 0 elsewhere."""
  out = np.zeros(batch.loss_mask.shape)
  for b, turns in enumerate(per_turn):
    for t, a in enumerate(turns):
      out[b] = np.where(batch.loss_mask[b] & (batch.turn_ids[b] == t), a, out[b])
  return out


SETTINGS = [(1.0, 1.0, True), (0.9, 0.5, True), (0.95, 2.0, False), (0.6, 1.0, False)]


@pytest.mark.parametrize("gamma, omega, step_normalize", SETTINGS)
def test_token_advantages_match_the_reference(gamma, omega, step_normalize):
  """Shared and revisited states, gamma < 1, omega != 1, both F_norm, excluded episodes."""
  batch = build_batch(EPISODES)
  got = gigpo.token_advantages(batch, gamma=gamma, omega=omega, step_normalize=step_normalize)
  assert got.dtype == np.float32 and got.shape == batch.loss_mask.shape
  want = expected_tokens(batch, reference(EPISODES, gamma, omega, step_normalize))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(want[:3]).max() > 0.1  # The shared-state group carries signal.


def test_without_shared_states_the_step_part_vanishes():
  """Group 1 shares no state: every turn's advantage is its episode's A^E, for any omega."""
  batch = build_batch(EPISODES)
  rows = batch.group_ids == 1
  episode_adv = gigpo.episode_advantages(training_rewards(batch), batch.group_ids)[rows]
  assert np.abs(episode_adv).min() > 0.1
  for omega in (0.0, 1.0, 3.0):
    turns = gigpo.turn_advantages(training_rewards(batch), batch.group_ids,
                                  batch.step_rewards, batch.step_states, gamma=0.9, omega=omega)
    on = batch.step_states[rows] >= 0
    np.testing.assert_allclose(turns[rows][on], np.broadcast_to(episode_adv[:, None], on.shape)[on],
                               rtol=1e-6)


def test_excluded_episodes_get_zero_and_move_no_statistic():
  """The failed episode of group 2, and the lone survivor of group 3, get 0; dropping the failed
  episode from the batch changes nobody else's advantage."""
  batch = build_batch(EPISODES)
  got = gigpo.token_advantages(batch, gamma=0.9, omega=1.0)
  assert not got[8].any() and not got[10].any() and not got[11].any()
  kept = [i for i in range(len(EPISODES)) if i != 8]
  small = build_batch([EPISODES[i] for i in kept])

  def per_turn(b):
    return gigpo.turn_advantages(training_rewards(b), b.group_ids, b.step_rewards,
                                 b.step_states, gamma=0.9, omega=1.0)

  np.testing.assert_allclose(per_turn(small), per_turn(batch)[kept], rtol=1e-6)
  # Counted, the failed episode would have moved its group's every advantage.
  counted = build_batch([(g, False, turns) if i == 8 else e
                         for i, (e, (g, _, turns)) in enumerate(zip(EPISODES, EPISODES))])
  moved = np.abs(per_turn(counted) - per_turn(batch))[[6, 7, 9], 0]
  assert moved.min() > 0.1


def test_omega_zero_is_grpo():
  """With omega = 0 every loss token carries the project's GRPO advantage of its episode."""
  batch = build_batch(EPISODES)
  got = gigpo.token_advantages(batch, gamma=0.9, omega=0.0)
  grpo_B = np.asarray(objective.grpo_advantages(training_rewards(batch), batch.group_ids,
                                                int(batch.group_ids.max()) + 1))
  want = np.where(batch.loss_mask & (batch.turn_ids >= 0), grpo_B[:, None], 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lone_and_all_equal_groups_give_exactly_zero():
  """Decided by count and max == min, not by the std: with eps = 0 a lone state (0 / 0) or a
  rounding residue of the mean (0.1 * 3 / 3 != 0.1) would give NaN or a spurious value."""
  adv = gigpo.episode_advantages(np.array([0.1, 0.1, 0.1, 0.7]), np.array([0, 0, 0, 1]), eps=0.0)
  assert (adv == 0.0).all()
  states = np.array([[1, 2], [1, 3], [1, -1]])
  got = gigpo.step_advantages(np.array([[0.1, 0.5], [0.1, 0.2], [0.1, 0.0]]), states,
                              np.zeros(3), np.ones(3, bool), eps=0.0)
  assert (got == 0.0).all()


def test_discounted_returns():
  """R_t = sum_{k >= t} gamma^(k - t) r_k, summed term by term."""
  rewards = np.random.default_rng(1).normal(size=(3, 6))
  got = gigpo.discounted_returns(rewards, 0.8)
  want = [[sum(0.8**(k - t) * rewards[b, k] for k in range(t, 6)) for t in range(6)]
          for b in range(3)]
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_bad_arguments_fail_with_one_line():
  batch = build_batch(EPISODES)
  for kw, match in (({"gamma": 0.0}, "gamma"), ({"gamma": 1.5}, "gamma"),
                    ({"omega": -1.0}, "omega"), ({"omega": float("nan")}, "omega")):
    with pytest.raises(ValueError, match=match):
      gigpo.token_advantages(batch, **kw)
  bare = EpisodeBatch(**{**vars(batch), "turn_ids": None})
  with pytest.raises(ValueError, match="per-turn records"):
    gigpo.token_advantages(bare)


def test_observation_hash_is_63_bit_blake2b():
  """Stable across processes (no PYTHONHASHSEED), non-negative so -1 stays free."""
  for text in ("", "SFFF\nFHFH", "Invalid reply: \u00e9"):
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    assert observation_hash(text) == int.from_bytes(digest, "little") // 2
    assert 0 <= observation_hash(text) < 2**63


# ----------------------------------------------------------------------------- the episode loop


@pytest.fixture(scope="module")
def chat(smoke_tiny_dir):
  tok = hf.load_pretrained(smoke_tiny_dir).tokenizer
  return agent.ChatFormat(tok, [tok.convert_tokens_to_ids("<|im_end|>")])


def test_collect_episodes_records_turns_rewards_and_states(chat):
  """A real FrozenLake played by a scripted policy: each loss token's turn, each turn's reward
  and the hash of the observation it answered are what the env itself shows and returns."""
  spec, seeds, group = "frozenlake:easy", (3, 8), 3
  env = registry.make(spec)
  scripts = []
  for seed in seeds:
    env.reset(seed)
    expert = env.solve()
    # Invalid actions (penalised, same message twice: a revisit), edge bumps, the expert, and
    # an episode the turn budget cuts.
    scripts += [expert, ["jump", "jump"] + expert, ["up", "left", "up"] + expert + ["up"] * 9]
  instances = [agent.Instance(0, spec, seed) for seed in seeds]
  policy = agent.ScriptedPolicy(chat, scripts, 64)
  batch = agent.collect_episodes(policy, chat, registry.make, instances, group,
                                 max_turns=MAX_TURNS + 2, max_new_tokens=64, max_slots=1 << 20)
  n_turns = MAX_TURNS + 2
  assert batch.step_states.shape == batch.step_rewards.shape == (len(scripts), n_turns)
  stop = chat.tokenizer.decode([chat.stop_token_ids[0]])
  episodes = []  # What the env shows and returns, for the reference.
  for b, actions in enumerate(scripts):
    played = play(registry.make(spec), seeds[b // group], actions[:n_turns])
    turns = len(played.actions)
    episodes.append((b // group, False, list(zip(played.observations, played.rewards))))
    assert batch.turns[b] == turns and not batch.failed[b]
    np.testing.assert_array_equal(
        batch.step_states[b], [observation_hash(o) for o in played.observations[:turns]]
        + [-1] * (n_turns - turns))
    np.testing.assert_allclose(batch.step_rewards[b],
                               list(played.rewards) + [0.0] * (n_turns - turns), atol=1e-7)
    assert batch.step_rewards[b].sum() == pytest.approx(batch.rewards[b], abs=1e-6)
    spans = runs(batch.loss_mask[b])
    assert len(spans) == turns
    for t, (s, e) in enumerate(spans):
      assert (batch.turn_ids[b, s:e] == t).all()
      assert chat.tokenizer.decode(batch.tokens[b, s:e]) == f"<action>{actions[t]}</action>{stop}"
    assert (batch.turn_ids[b][~batch.loss_mask[b]] == -1).all()
  # The scripts cover what they claim: a cut episode, an ended one, penalties, a revisit.
  assert batch.truncated[2] and (batch.step_states[0] == -1).any()
  assert (batch.step_rewards < 0).any()
  assert any(len({o for o, _ in e[2]}) < len(e[2]) for e in episodes)
  # The whole chain: advantages from the loop's records equal the reference on the env's texts.
  got = gigpo.token_advantages(batch, gamma=0.9, omega=1.0)
  want = expected_tokens(batch, reference(episodes, 0.9, 1.0, True))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(want).max() > 0.1


# ----------------------------------------------------------------------------- config


def test_config_accepts_gigpo_and_checks_its_fields(tmp_path):
  # The default's per-task std is a GRPO option: another estimator is chosen without it.
  config_check.validate(smoke_config(tmp_path, advantage_estimator="gigpo", per_task_std=False))
  for overrides, message in (
      ({"gigpo.gamma": 0.0}, "config.gigpo.gamma=0.0 must be in (0, 1]"),
      ({"gigpo.gamma": 1.2}, "config.gigpo.gamma=1.2 must be in (0, 1]"),
      ({"gigpo.omega": -0.5}, "config.gigpo.omega=-0.5 must be >= 0"),
      ({"gigpo.omega": float("inf")}, "config.gigpo.omega=inf"),
      ({"advantage_estimator": "gigpo", "per_task_std": True}, "config.per_task_std")):
    with pytest.raises(config_check.ConfigError, match=message.replace("(", r"\(").replace(
        ")", r"\)")) as e:
      config_check.validate(smoke_config(tmp_path, **overrides))
    assert "\n" not in str(e.value)
