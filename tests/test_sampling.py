"""Sampling engine: cache parity, logprob consistency, HF greedy parity, sampling statistics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import eppo_jax
from eppo_jax import logprobs, lora
from eppo_jax import sampling
from eppo_jax.models.config import LoraConfig, ModelConfig
from eppo_jax.models.transformer import init_params
from eppo_jax.sampling import SamplingConfig

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)
TOL = 1e-4
# The uncached reference forward, jitted once per config (eager op-by-op dispatch is slow).
full_logits = jax.jit(eppo_jax.logits, static_argnums=1)


@pytest.fixture(scope="module")
def params():
  return init_params(TINY, jax.random.PRNGKey(0))


def _ragged_prompts(rng, lengths, vocab=TINY.vocab_size):
  """Random token lists of the given lengths, avoiding id 0 (the pad)."""
  return [list(rng.integers(1, vocab, size=n)) for n in lengths]


def _compact(chunks):
  """Drops pads from a conversation of chunks -> (tokens [B,T], mask [B,T], index maps).

  `chunks` is a list of (tokens [B,C], mask [B,C]); each row's valid tokens are concatenated in
  order and right-padded. `where[c][i, j]` is the compact position of chunk c's token (i, j).
  """
  b = chunks[0][0].shape[0]
  rows, where = [[] for _ in range(b)], []
  for tokens, mask in chunks:
    pos = np.full(tokens.shape, -1)
    for i in range(b):
      for j in np.flatnonzero(mask[i]):
        pos[i, j] = len(rows[i])
        rows[i].append(int(tokens[i, j]))
    where.append(pos)
  t = max(len(r) for r in rows)
  tokens_BxT = np.zeros((b, t), np.int32)
  mask_BxT = np.zeros((b, t), bool)
  for i, r in enumerate(rows):
    tokens_BxT[i, :len(r)], mask_BxT[i, :len(r)] = r, True
  return tokens_BxT, mask_BxT, where


def _teacher_forced(params, config, chunks, temperature):
  """Per-chunk (logprobs, entropies) of each token recomputed by one uncached forward."""
  tokens_BxT, mask_BxT, where = _compact(chunks)
  logits_BxTxV = full_logits(params, config, jnp.asarray(tokens_BxT), jnp.asarray(mask_BxT))
  # Token j is predicted by the logits at j - 1.
  lp, ent = logprobs.token_logprobs_and_entropy(logits_BxTxV[:, :-1],
                                                jnp.asarray(tokens_BxT[:, 1:]), temperature)
  lp, ent = np.asarray(lp), np.asarray(ent)
  out = []
  for pos in where:
    rows = np.arange(pos.shape[0])[:, None]
    prev = np.maximum(pos - 1, 0)
    out.append((np.where(pos > 0, lp[rows, prev], 0.0), np.where(pos > 0, ent[rows, prev], 0.0)))
  return out


# ----------------------------------------------------------------------------------------------


def test_bucket_and_left_pad():
  assert sampling.bucket(1, (8, 16)) == 8
  assert sampling.bucket(8, (16, 8)) == 8
  assert sampling.bucket(9, (8, 16)) == 16
  with pytest.raises(ValueError, match="largest bucket"):
    sampling.bucket(17, (8, 16))
  tokens, mask = sampling.left_pad([[5, 6], [7, 8, 9], []], (4, 8), pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [0, 7, 8, 9], [0, 0, 0, 0]])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]])


def test_sampling_config_validation():
  with pytest.raises(ValueError):
    SamplingConfig(temperature=0.0)
  with pytest.raises(ValueError):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError):
    SamplingConfig(max_new_tokens=0)
  assert hash(SamplingConfig(stop_token_ids=[3, 4])) == hash(SamplingConfig(stop_token_ids=(3, 4)))


@jax.jit
def _extend(params, cache, tokens_BxT, mask_BxT):
  """Appends a left-padded chunk to the cache -> (logits [B,T,V], cache)."""
  return eppo_jax.forward_with_cache(params, TINY, tokens_BxT, mask_BxT, cache)


def test_cached_decode_logits_equal_uncached_forward(params):
  """Prefill + ragged chunk + one-token steps through the cache == one full forward."""
  rng = np.random.default_rng(0)
  prompt, prompt_mask = sampling.left_pad(_ragged_prompts(rng, [3, 7, 5]), (8,), 0)
  obs, obs_mask = sampling.left_pad(_ragged_prompts(rng, [4, 1, 2]), (4,), 0)
  steps = [(rng.integers(1, 128, (3, 1)).astype(np.int32), np.array([[1], [1], [0]], bool))
           for _ in range(3)]
  chunks = [(prompt, prompt_mask), steps[0], (obs, obs_mask), steps[1], steps[2]]
  cache = eppo_jax.init_cache(TINY, 3, 24)
  cached = []
  for tokens, mask in chunks:
    logits, cache = _extend(params, cache, jnp.asarray(tokens), jnp.asarray(mask))
    cached.append(np.asarray(logits))
  assert int(cache["index"]) == 8 + 1 + 4 + 1 + 1

  tokens_BxT, mask_BxT, where = _compact(chunks)
  full = np.asarray(full_logits(params, TINY, jnp.asarray(tokens_BxT), jnp.asarray(mask_BxT)))
  for logits, pos in zip(cached, where):
    for i, j in zip(*np.nonzero(pos >= 0)):
      np.testing.assert_allclose(logits[i, j], full[i, pos[i, j]], atol=TOL, rtol=0)


def test_rollout_logprobs_match_teacher_forced(params):
  rng = np.random.default_rng(1)
  prompt, mask = sampling.left_pad(_ragged_prompts(rng, [2, 6, 4, 5]), (8,), 0)
  cfg = SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9,
                       stop_token_ids=(3, 9, 17))
  out = sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(mask),
                         jax.random.PRNGKey(2), cfg)
  resp = (np.asarray(out.tokens), np.asarray(out.mask))
  (_, _), (lp, ent) = _teacher_forced(params, TINY, [(prompt, mask), resp], cfg.temperature)
  np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(out.entropies), ent, atol=TOL, rtol=0)
  assert np.all(np.asarray(out.entropies)[resp[1]] > 0)


def test_multi_turn_extension_matches_compacted_conversation(params):
  """prompt + reply + observation + reply through one cache == teacher-forced, compacted."""
  rng = np.random.default_rng(3)
  prompt, prompt_mask = sampling.left_pad(_ragged_prompts(rng, [3, 8, 5]), (8,), 0)
  cfg = SamplingConfig(max_new_tokens=6, temperature=1.3, top_p=0.95,
                       stop_token_ids=tuple(range(1, 30)))
  max_len = 8 + 6 + 4 + 6
  turn1 = sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(prompt_mask),
                           jax.random.PRNGKey(4), cfg, max_len=max_len)
  reply1 = (np.asarray(turn1.tokens), np.asarray(turn1.mask))
  obs, obs_mask = sampling.left_pad(_ragged_prompts(rng, [2, 4, 1]), (4,), 0)
  turn2 = sampling.rollout(params, TINY, jnp.asarray(obs), jnp.asarray(obs_mask),
                           jax.random.PRNGKey(5), cfg, cache=turn1.cache)
  reply2 = (np.asarray(turn2.tokens), np.asarray(turn2.mask))
  assert int(turn2.cache["index"]) == 8 + reply1[1].sum(1).max() + 4 + reply2[1].sum(1).max()

  recomputed = _teacher_forced(params, TINY, [(prompt, prompt_mask), reply1, (obs, obs_mask),
                                              reply2], cfg.temperature)
  for out, (lp, ent) in ((turn1, recomputed[1]), (turn2, recomputed[3])):
    np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.entropies), ent, atol=TOL, rtol=0)


def test_stop_tokens_end_rows_and_mask_the_rest(params):
  stop = tuple(range(1, 64))  # Half the vocabulary: every row stops within a few steps.
  prompt, mask = sampling.left_pad(_ragged_prompts(np.random.default_rng(5), [4] * 6), (4,), 0)
  cfg = SamplingConfig(max_new_tokens=16, stop_token_ids=stop, pad_id=0)
  out = sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(mask),
                         jax.random.PRNGKey(6), cfg)
  tokens, m = np.asarray(out.tokens), np.asarray(out.mask)
  lengths = np.asarray(out.lengths)
  np.testing.assert_array_equal(lengths, m.sum(1))
  for i, n in enumerate(lengths):
    assert np.all(m[i, :n]) and not np.any(m[i, n:])
    assert tokens[i, n - 1] in stop  # Stops on (and keeps) the first stop id ...
    assert not np.isin(tokens[i, :n - 1], stop).any()
    assert np.all(tokens[i, n:] == 0)  # ... and is padded after it.
  assert np.all(np.asarray(out.logprobs)[~m] == 0) and np.all(np.asarray(out.entropies)[~m] == 0)
  # The loop exits as soon as the last row stops: one slot per step actually taken.
  assert lengths.max() < 16
  assert int(out.cache["index"]) == 4 + lengths.max()


def test_empty_chunk_rows_generate_nothing(params):
  prompt, mask = sampling.left_pad([[5, 6, 7], []], (4,), 0)
  out = sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(mask),
                         jax.random.PRNGKey(0), SamplingConfig(max_new_tokens=3))
  np.testing.assert_array_equal(np.asarray(out.lengths), [3, 0])


def test_rng_determinism(params):
  prompt, mask = sampling.left_pad(_ragged_prompts(np.random.default_rng(7), [5, 3]), (8,), 0)
  cfg = SamplingConfig(max_new_tokens=8)
  run = lambda seed: np.asarray(sampling.rollout(params, TINY, jnp.asarray(prompt),
                                                 jnp.asarray(mask), jax.random.PRNGKey(seed),
                                                 cfg).tokens)
  np.testing.assert_array_equal(run(0), run(0))
  assert not np.array_equal(run(0), run(1))


def test_a_row_draws_by_its_id_not_its_position(params):
  """Rows shuffled with their ids draw the same tokens; the same rows under other ids do not."""
  prompt, mask = sampling.left_pad(_ragged_prompts(np.random.default_rng(12), [5, 3, 6, 4]),
                                   (8,), 0)
  cfg = SamplingConfig(max_new_tokens=8)
  body = jax.jit(lambda t, m, ids: sampling.rollout_body(
      params, TINY, t, m, jax.random.PRNGKey(0), cfg, eppo_jax.init_cache(TINY, 4, 16),
      row_ids_B=ids).tokens)
  ids = np.array([7, 3, 12, 5], np.int32)
  order = np.array([2, 0, 3, 1])
  tokens = np.asarray(body(prompt, mask, ids))
  np.testing.assert_array_equal(np.asarray(body(prompt[order], mask[order], ids[order])),
                                tokens[order])
  assert not np.array_equal(np.asarray(body(prompt, mask, ids + 1)), tokens)


def test_lora_params_sample_from_the_adapted_policy(params):
  lora_cfg, lora_params = lora.add_lora(params, TINY, LoraConfig(rank=4), jax.random.PRNGKey(1))
  # Nonzero B, so the adapters change the policy.
  lora_params = jax.tree_util.tree_map_with_path(
      lambda path, x: (jax.random.normal(jax.random.PRNGKey(2), x.shape) * 0.5
                       if path[-1].key == "lora_b" else x), lora_params)
  prompt, mask = sampling.left_pad(_ragged_prompts(np.random.default_rng(8), [6, 2]), (8,), 0)
  cfg = SamplingConfig(max_new_tokens=8, temperature=0.9)
  out = sampling.rollout(lora_params, lora_cfg, jnp.asarray(prompt), jnp.asarray(mask),
                         jax.random.PRNGKey(3), cfg)
  resp = (np.asarray(out.tokens), np.asarray(out.mask))
  _, (lp, _) = _teacher_forced(lora_params, lora_cfg, [(prompt, mask), resp], cfg.temperature)
  np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=TOL, rtol=0)
  _, (lp_base, _) = _teacher_forced(lora.base_params(lora_params), lora_cfg, [(prompt, mask), resp],
                                    cfg.temperature)
  assert np.abs(lp - lp_base).max() > 1e-2


def test_rollout_inside_pmap_samples_each_shard(params):
  """Each device's output equals an unmapped rollout of its shard with its key."""
  d = jax.local_device_count()  # 4 under the test suite's XLA_FLAGS.
  prompts, mask = sampling.left_pad(_ragged_prompts(np.random.default_rng(9), [3, 5] * d), (8,), 0)
  prompts_DxBxP, mask_DxBxP = prompts.reshape(d, 2, 8), mask.reshape(d, 2, 8)
  keys = jax.random.split(jax.random.PRNGKey(10), d)
  cfg = SamplingConfig(max_new_tokens=6, temperature=0.8, stop_token_ids=(7,))
  mapped = jax.pmap(lambda p, t, m, k: sampling.rollout(p, TINY, t, m, k, cfg),
                    in_axes=(None, 0, 0, 0))(params, prompts_DxBxP, mask_DxBxP, keys)
  for i in range(d):
    ref = sampling.rollout(params, TINY, jnp.asarray(prompts_DxBxP[i]), jnp.asarray(mask_DxBxP[i]),
                           keys[i], cfg)
    np.testing.assert_array_equal(np.asarray(mapped.tokens[i]), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(mapped.logprobs[i]), np.asarray(ref.logprobs),
                               atol=TOL, rtol=0)


def test_no_recompilation_within_a_bucket(params):
  rng = np.random.default_rng(11)
  cfg = SamplingConfig(max_new_tokens=4, temperature=0.5)
  run = lambda lengths: sampling.rollout(
      params, TINY, *map(jnp.asarray, sampling.left_pad(_ragged_prompts(rng, lengths), (8, 16), 0)),
      jax.random.PRNGKey(0), cfg)
  run([3, 5])
  before = sampling.compiled_programs()
  run([7, 2])
  run([8, 1])
  assert sampling.compiled_programs() == before  # Same bucket (8): no new program.
  run([12, 3])
  assert sampling.compiled_programs() == before + 1  # Next bucket (16): exactly one more.


def test_cache_overflow_is_refused(params):
  prompt, mask = sampling.left_pad([[5, 6, 7]], (4,), 0)
  cfg = SamplingConfig(max_new_tokens=4)
  with pytest.raises(ValueError, match="max_len"):
    sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(mask), jax.random.PRNGKey(0),
                     cfg, max_len=6)
  out = sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(mask),
                         jax.random.PRNGKey(0), dataclasses.replace(cfg, max_new_tokens=2),
                         max_len=10)
  with pytest.raises(ValueError, match="slots"):
    sampling.rollout(params, TINY, jnp.asarray(prompt), jnp.asarray(mask), jax.random.PRNGKey(0),
                     cfg, cache=out.cache)
  # Under an outer jit the index is traced: the overflowing chunk is poisoned, never clamped.
  cache = eppo_jax.init_cache(TINY, 1, 8)
  cache["index"] = jnp.asarray(4, jnp.int32)
  logprobs = jax.jit(lambda c: sampling.rollout_body(
      params, TINY, jnp.asarray(prompt), jnp.asarray(mask), jax.random.PRNGKey(0), cfg,
      c).logprobs)(cache)
  assert np.isnan(np.asarray(logprobs)[0, 0])


# ----------------------------------------------------------------------------------------------
# Sampling statistics: empirical next-token frequencies vs. the distribution computed in NumPy.


def _expected_distribution(logits_V, temperature, top_k, top_p):
  z = logits_V.astype(np.float64) / temperature
  keep = np.ones_like(z, bool)
  if top_k:
    keep &= z >= np.sort(z)[::-1][top_k - 1]
  zk = np.where(keep, z, -np.inf)
  if top_p < 1:
    order = np.argsort(-zk)
    probs = np.exp(zk[order] - zk[order][0])
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    nucleus = np.zeros_like(keep)
    nucleus[order[mass_before < top_p]] = True
    keep &= nucleus
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.5, 0, 0.7),
                                                     (1.2, 8, 0.8)])
def test_sampling_frequencies_match_the_truncated_distribution(params, temperature, top_k, top_p):
  """8000 one-token draws vs. the NumPy distribution: chi-square at p >= 1e-4 and TV <= 0.04."""
  # A 3x sharper head gives ~15 effective tokens (of 128): sampling noise is then TV ~ 0.01-0.025,
  # while a wrong temperature, k or p (k+1, p+0.05 included) moves TV by 0.05-0.45.
  sharp = jax.tree_util.tree_map(lambda x: x, params)
  sharp["params"]["lm_head"]["kernel"] = params["params"]["lm_head"]["kernel"] * 3.0
  prompt = np.array([[11, 22, 33, 44]], np.int32)
  logits_V = np.asarray(full_logits(sharp, TINY, jnp.asarray(prompt),
                                    jnp.ones_like(prompt, bool))[0, -1])
  expected = _expected_distribution(logits_V, temperature, top_k, top_p)
  n = 8000
  cfg = SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
  out = sampling.rollout(sharp, TINY, jnp.asarray(np.repeat(prompt, n, 0)),
                         jnp.ones((n, 4), bool), jax.random.PRNGKey(12), cfg)
  counts = np.bincount(np.asarray(out.tokens)[:, 0], minlength=TINY.vocab_size)
  assert counts[expected == 0].sum() == 0  # Truncated tokens are never drawn.
  assert 0.5 * np.abs(counts / n - expected).sum() <= 0.04
  # Chi-square over tokens expected >= 5 times, the rest pooled into one bin.
  big = n * expected >= 5
  observed = np.append(counts[big], counts[~big].sum())
  predicted = np.append(n * expected[big], n * expected[~big].sum())
  keep = predicted > 0
  chi2 = np.sum((observed[keep] - predicted[keep]) ** 2 / predicted[keep])
  assert chi2 <= scipy.stats.chi2.ppf(1 - 1e-4, keep.sum() - 1), chi2
  # The reported logprob is that of the untruncated temperature-scaled policy.
  full = np.exp(logits_V / temperature - np.logaddexp.reduce(logits_V / temperature))
  np.testing.assert_allclose(np.exp(np.asarray(out.logprobs)[:, 0]),
                             full[np.asarray(out.tokens)[:, 0]], rtol=1e-4)


# ----------------------------------------------------------------------------------------------


def test_greedy_matches_transformers_generate(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(
      vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      initializer_range=0.2,  # Peaked logits: far from argmax ties that float noise could flip.
      pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(hf_config).eval()
  model.save_pretrained(tmp_path)
  pre = eppo_jax.load_pretrained(tmp_path, with_tokenizer=False)

  prompt, mask = sampling.left_pad(_ragged_prompts(np.random.default_rng(13), [7, 3, 5]), (8,), 0)
  n = 12
  with torch.no_grad():
    hf_out = model.generate(input_ids=torch.tensor(prompt, dtype=torch.long),
                            attention_mask=torch.tensor(mask, dtype=torch.long),
                            do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
  hf_tokens = hf_out[:, prompt.shape[1]:].numpy()
  out = sampling.rollout(pre.params, pre.config, jnp.asarray(prompt), jnp.asarray(mask),
                         jax.random.PRNGKey(0), SamplingConfig(max_new_tokens=n, greedy=True))
  np.testing.assert_array_equal(np.asarray(out.tokens), hf_tokens)


def test_window_bucket():
  assert [sampling.window_bucket(n, 256) for n in (1, 64, 65, 100, 128, 129, 256)] == [
      64, 64, 128, 128, 128, 256, 256]
  assert sampling.window_bucket(5, 20) == 8  # Rounded up to a multiple of 8, capped at S.
  with pytest.raises(ValueError, match="only 24"):
    sampling.window_bucket(25, 24)


def test_rollout_over_the_used_window_equals_the_full_cache(params):
  """Three turns attending over bucketed windows of a 256-slot cache == over all 256 slots."""
  rng = np.random.default_rng(14)
  cfg = SamplingConfig(max_new_tokens=6, greedy=True, stop_token_ids=(3,))
  chunks = [sampling.left_pad(_ragged_prompts(rng, lengths), (8,), 0)
            for lengths in ([3, 8, 5], [2, 4, 1], [6, 1, 3])]
  outs = {}
  for name in ("bucketed", "full"):
    cache, outs[name] = None, []
    for turn, (tokens, mask) in enumerate(chunks):
      kw = dict(max_len=256) if cache is None else dict(cache=cache)
      window = 256 if name == "full" else None
      out = sampling.rollout(params, TINY, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.PRNGKey(turn), cfg, window=window, **kw)
      cache = out.cache
      outs[name].append(out)
  assert sampling.window_bucket(8 + 6, 256) == 64  # The first turn reads 64 of 256 slots.
  for bucketed, full in zip(outs["bucketed"], outs["full"]):
    np.testing.assert_array_equal(np.asarray(bucketed.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(bucketed.mask), np.asarray(full.mask))
    np.testing.assert_allclose(np.asarray(bucketed.logprobs), np.asarray(full.logprobs),
                               atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="window"):
    sampling.rollout(params, TINY, jnp.asarray(chunks[0][0]), jnp.asarray(chunks[0][1]),
                     jax.random.PRNGKey(0), cfg, max_len=256, window=8)


@pytest.mark.parametrize("unroll", [False, True])
def test_decode_layer_loop_rolled_or_unrolled_equals_uncached(params, unroll):
  """Both decode layer loops (scan over stacked weights / unrolled over split ones) match."""
  config = TINY.replace(unroll_layers=unroll)
  rng = np.random.default_rng(15)
  prompt, mask = sampling.left_pad(_ragged_prompts(rng, [3, 7]), (8,), 0)
  cfg = SamplingConfig(max_new_tokens=5, temperature=0.8)
  turn1 = sampling.rollout(params, config, jnp.asarray(prompt), jnp.asarray(mask),
                           jax.random.PRNGKey(1), cfg, max_len=32)
  reply1 = (np.asarray(turn1.tokens), np.asarray(turn1.mask))
  obs, obs_mask = sampling.left_pad(_ragged_prompts(rng, [2, 4]), (4,), 0)
  turn2 = sampling.rollout(params, config, jnp.asarray(obs), jnp.asarray(obs_mask),
                           jax.random.PRNGKey(2), cfg, cache=turn1.cache)
  reply2 = (np.asarray(turn2.tokens), np.asarray(turn2.mask))
  recomputed = _teacher_forced(params, TINY, [(prompt, mask), reply1, (obs, obs_mask), reply2],
                               cfg.temperature)
  for out, (lp, _) in ((turn1, recomputed[1]), (turn2, recomputed[3])):
    np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=TOL, rtol=0)
