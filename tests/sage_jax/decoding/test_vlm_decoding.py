"""SAGE on vision-language targets (Qwen2.5-VL's 3-D M-RoPE and LLaVA-OneVision), tiny random models with real
tokenizers and image processors: every policy's greedy output equals AR, with draft-side visual-token pruning on
and off, for a batch mixing one image with two images of other sizes and a video; every kind of draft (a smaller
VLM of the family, a self-draft, an EAGLE-style head); one compile across image counts and sizes inside a
bucket; sampled rows follow the target's distribution; pruning keeps what it says it keeps."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from scipy import stats

from sage_jax.decoding import visual_pruning as vp
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine
from sage_jax.models import eagle_head
from sage_jax.models.eagle_head import EagleWeights

ARCHS = ("qwen2_5_vl", "llava_onevision")
N_NEW = 24


def _image(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _video(seed, frames=4):
    return np.random.default_rng(seed).integers(0, 256, (frames, 56, 56, 3), dtype=np.uint8)


PROMPTS = ["Describe the picture.", "What is shown here? How many frames does the video have?"]
IMAGES = [[_image(56, 84, 0)], [_image(56, 56, 1), _image(84, 56, 2)]]
VIDEOS = [[], [_video(3)]]


# Under -m integration: the default suite decodes the shipped VLM (a LLaVA-OneVision) with its draft VLM on an image
# and a clip (tests/sage_jax/training/test_vlm_draft.py), and checks both families' parity with transformers
# (tests/sage_jax/models/).
ARCHS_IN_INTEGRATION = [pytest.param(a, marks=pytest.mark.integration) for a in ARCHS]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_vlm):
    """(arch, target, a smaller draft VLM of its family: one of the target's two layers, perturbed)."""
    target = tiny_vlm(request.param, 0)
    return request.param, target, tiny_vlm(request.param, 1, n_layers=1, like=target, noise=0.05)


@pytest.fixture(scope="module")
def reference(pair):
    """The AR engine's tokens for PROMPTS, checked against the model's own greedy `generate` on row 0."""
    _, target, draft = pair
    engine = Engine(target, draft)
    ref = engine.generate(PROMPTS, policy="ar", images=IMAGES, videos=VIDEOS, max_new_tokens=N_NEW)
    own = target.generate(max_new_tokens=N_NEW, **target.inputs(PROMPTS[0], images=IMAGES[0]))[0].tolist()
    assert ref.token_ids[0] == own[: len(ref.token_ids[0])]
    return engine, ref.token_ids


@pytest.mark.integration
def test_every_policy_matches_ar_with_and_without_pruning(pair, reference):
    """chain without pruning; static, EAGLE-2 and SAGE with 80% / 90% of the image / video tokens pruned from the
    draft's prompt, ranked by the target's attention or evenly spaced."""
    _, target, draft = pair
    engine, ref = reference
    uniform = Engine(target, draft, prune="uniform")
    runs = [(engine, "chain", 0.0), (engine, "static", None), (uniform, "eagle2", None),
            (engine, TreePolicy.sage(n_max=16, frontier=4, d_min=1), None)]
    tau = 0.0
    for eng, policy, ratio in runs:
        out = eng.generate(PROMPTS, policy=policy, images=IMAGES, videos=VIDEOS, max_new_tokens=N_NEW,
                           prune_ratio=ratio)
        assert out.token_ids == ref, (policy, eng.prune, ratio)
        st = out.stats
        assert st.draft_forwards > st.steps
        if ratio == 0.0:
            assert st.draft_prompt_tokens == st.prompt_tokens
        else:  # the draft saw fewer tokens: 20% of the image tokens, 10% of the video's (at least one each)
            vis = engine_visual(target)
            kept = sum(sum(vp.keep_counts(i, v, vp.DEFAULT_RATIOS)) for i, v in vis)
            assert st.prompt_tokens - st.draft_prompt_tokens == sum(i + v for i, v in vis) - kept
        tau += st.mean_accepted
    assert tau > 0  # the trees were really used


@pytest.mark.slow
@pytest.mark.parametrize("prune", vp.METHODS)
def test_every_policy_with_pruning_on_and_off(pair, reference, prune):
    """The full product (slow): every policy, pruning off and at the default ratios, both ranking methods."""
    _, target, draft = pair
    _, ref = reference
    engine = Engine(target, draft, prune=prune)
    for policy, ratio in itertools.product(("chain", "static", "eagle2", "sage"), (0.0, None)):
        out = engine.generate(PROMPTS, policy=policy, images=IMAGES, videos=VIDEOS, max_new_tokens=N_NEW,
                              prune_ratio=ratio)
        assert out.token_ids == ref, (policy, prune, ratio)


def engine_visual(target):
    """(image tokens, video tokens) of each prompt."""
    out = []
    for p, im, vi in zip(PROMPTS, IMAGES, VIDEOS, strict=True):
        ids = target.inputs(p, images=im, videos=vi)["input_ids"][0]
        cfg = target.config
        out.append((int((ids == cfg.image_token_id).sum()), int((ids == cfg.video_token_id).sum())))
    return out


@pytest.mark.parametrize("pair", ARCHS_IN_INTEGRATION, indirect=True)
def test_one_compile_across_image_counts_and_sizes(pair, reference):
    """After one SAGE run, prompts with other numbers and sizes of images (and no video) whose target and draft
    lengths stay in the same buckets reuse both compiled loops, and still equal AR."""
    _, target, draft = pair
    engine, _ = reference
    sage = TreePolicy.sage(n_max=16, frontier=4, d_min=1)
    kw = dict(policy=sage, max_new_tokens=N_NEW)
    engine.generate(PROMPTS, images=IMAGES, videos=VIDEOS, **kw)
    compiles = engine.compiles
    images = [[_image(112, 112, 5), _image(84, 84, 6), _image(56, 56, 7)], [_image(56, 112, 8)]]
    prompts = PROMPTS[::-1]
    assert _buckets(engine, prompts, images, None) == _buckets(engine, PROMPTS, IMAGES, VIDEOS)  # the premise
    out = engine.generate(prompts, images=images, **kw)
    assert engine.compiles == compiles
    ar = Engine(target, draft).generate(prompts, images=images, policy="ar", max_new_tokens=N_NEW)
    assert out.token_ids == ar.token_ids


def _buckets(engine, prompts, images, videos):
    """(target, draft) prompt buckets of a batch."""
    from sage_jax.decoding import media_batch
    from sage_jax.engine import bucket

    v = media_batch.prepare(engine.vision, prompts, images, videos)
    _, lens = media_batch.draft_lengths(v, engine.prune_ratio)
    return bucket(max(map(len, v.ids))), bucket(max(lens))


@pytest.mark.integration
@pytest.mark.parametrize("arch", ARCHS)
def test_self_draft_and_eagle_head_on_vlms(arch, tiny_vlm):
    """A self-draft (the target's first layer) and an EAGLE-style head over the target's features, both reading
    the target's spliced embeddings, pruned: lossless."""
    target = tiny_vlm(arch, 0)
    ref = Engine(target).generate(PROMPTS[1:], images=IMAGES[1:], videos=VIDEOS[1:], policy="ar",
                                  max_new_tokens=N_NEW).token_ids
    lm = target.serving()
    cfg = eagle_head.head_config(lm.cfg)
    head = EagleWeights(head=jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, eagle_head.init_params(cfg, 1)),
                        vocab=None, cfg=cfg)
    for draft in (None, head):
        out = Engine(target, draft).generate(PROMPTS[1:], images=IMAGES[1:], videos=VIDEOS[1:], policy="static",
                                             max_new_tokens=N_NEW)
        assert out.token_ids == ref and out.stats.draft_prompt_tokens < out.stats.prompt_tokens


# ---------------------------------------------------------------------------------------------- T > 0

ROWS, N_SAMPLED, TEMPERATURE = 3000, 2, 0.5


def _exact(vlm, inputs, temperature):
    """P(x1, x2 | prompt) for every pair: x1 from the model's own call, x2 from its language model over the
    prompt's embeddings extended by each candidate x1 (as a generated token: a placeholder id is text there, which
    a processor-level call could not express), at the position after the prompt."""
    v = vlm.config.text.vocab_size
    logp1 = jax.nn.log_softmax(vlm(**inputs)[0, -1] / temperature)
    emb, pos, delta = vlm.embed(**inputs)
    lm = vlm.serving()
    t = emb.shape[1]
    emb2 = jnp.concatenate([jnp.repeat(emb, v, 0), lm.embed[:, None].astype(emb.dtype)], 1)
    nxt = jnp.full((v, 1) + pos.shape[2:], t + int(delta[0]), jnp.int32)
    pos2 = jnp.concatenate([jnp.repeat(pos, v, 0), nxt], 1)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t + 1, t + 1), bool)), (v, t + 1, t + 1))
    hidden, _ = lm.forward(None, pos2, mask, embeddings=emb2)
    logp2 = jax.nn.log_softmax(lm.head(hidden)[:, -1] / temperature, axis=-1)
    probs = np.exp(np.asarray(logp1[:, None] + logp2, np.float64))
    return probs / probs.sum()


def _chi2_pvalue(samples, probs, eos):
    """Chi-square of 2-token samples against `probs` [V, V]; a row that stops at EOS is the cell (EOS, anything)."""
    counts = np.zeros(probs.shape)
    for row in samples:
        counts[row[0], row[1] if len(row) > 1 else 0] += 1
    p = probs.copy()
    p[eos, 0], p[eos, 1:] = p[eos].sum(), 0.0
    counts, expected = counts.reshape(-1), p.reshape(-1) * len(samples)
    small = expected < 5  # pooled, so that the chi-square approximation holds
    obs = np.append(counts[~small], counts[small].sum())
    return stats.chisquare(obs, np.append(expected[~small], expected[small].sum())).pvalue


@pytest.mark.integration
def test_sampled_rows_follow_the_target_distribution(tiny_vlm):
    """At T = 0.5, 3,000 rows of one image prompt decoded by the static tree and by EAGLE-2's (draft pruned 80%)
    follow the target's exact distribution over 2-token continuations (chi-square); samples of the draft itself
    fail. (SAGE's thresholds admit almost no node from this pair's flat 320-token distributions; its sampling is
    tested on text, test_sampling_distribution.py, and its VLM path greedily above.)"""
    target = tiny_vlm("qwen2_5_vl", 0, scale=8.0)  # peaked: ~700 effective continuations at T = 0.5
    draft = tiny_vlm("qwen2_5_vl", 1, like=target, noise=0.03)
    inputs = target.inputs(PROMPTS[0], images=IMAGES[0])
    probs = _exact(target, inputs, TEMPERATURE)
    (eos,) = target.config.text.eos_token_ids
    engine = Engine(target, draft)
    for policy in ("static", TreePolicy.eagle2(n_max=8, depth=3, top_k=4)):
        # One token past the pair: τ counts committed draft tokens, and a step with a single token left commits none.
        out = engine.generate([inputs] * ROWS, policy=policy, max_new_tokens=N_SAMPLED + 1,
                              temperature=TEMPERATURE, seed=3)
        assert out.stats.mean_accepted > 0.02 and out.stats.draft_prompt_tokens < out.stats.prompt_tokens
        assert _chi2_pvalue(out.token_ids, probs, eos) > 1e-3, policy
    drafted = Engine(draft).generate([inputs] * ROWS, policy="ar", max_new_tokens=N_SAMPLED,
                                              temperature=TEMPERATURE)
    assert _chi2_pvalue(drafted.token_ids, probs, eos) < 1e-6  # the test can tell a wrong distribution


# ---------------------------------------------------------------------------------------------- pruning


def test_keep_mask_keeps_the_counts_it_is_given():
    """Uniform spacing and attention ranking keep exactly `keep` tokens of each kind (the highest-scored ones),
    every text slot, and no padding; the compacted index lists the kept slots in order, left-padded."""
    kind = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 0, 2, 2, 2, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]])
    pad = jnp.asarray([0, 2])
    keep = jnp.asarray([[2, 1], [1, 0]])
    score = jnp.asarray(np.random.default_rng(0).random(kind.shape), jnp.float32)
    for method in vp.METHODS:
        m = np.asarray(vp.keep_mask(method, kind, pad, keep, score))
        k = np.asarray(kind)
        assert [(m[b] & (k[b] == 1)).sum() for b in range(2)] == [2, 1]
        assert [(m[b] & (k[b] == 2)).sum() for b in range(2)] == [1, 0]
        assert m[0][k[0] == 0].all() and not m[1][:2].any() and m[1][2:4].all()
        if method == "attention":
            s = np.asarray(score)
            top = np.argsort(-np.where(k[0] == 1, s[0], -np.inf))[:2]
            assert set(np.flatnonzero(m[0] & (k[0] == 1))) == set(top)
        idx, pad_d = vp.compact_index(jnp.asarray(m), 16)
        for b in range(2):
            assert np.asarray(idx)[b, int(pad_d[b]):].tolist() == np.flatnonzero(m[b]).tolist()


def test_keep_counts():
    assert vp.keep_counts(100, 40, (0.8, 0.9)) == (20, 4)
    assert vp.keep_counts(3, 0, (0.9, 0.9)) == (1, 0)  # a present kind keeps one token below ratio 1
    assert vp.keep_counts(10, 10, (0.0, 1.0)) == (10, 0)  # 0 = off, 1 = a text-only draft
    with pytest.raises(ValueError, match="pruning ratio"):
        vp.keep_counts(1, 1, (1.5, 0.0))


def test_probe_attention_is_the_layers_softmax(tiny_lm):
    """The attention `LM.forward` reports for its probe rows equals softmax(q·k) recomputed from the layer's own
    projections, averaged over heads (one layer, so no averaging over layers)."""
    from sage_jax.decoding.autoregressive import prompt_layout
    from sage_jax.models import layers
    from sage_jax.models.serving_lm import Probe

    lm = tiny_lm(0, n_layers=1, vocab_size=64).serving()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 10)), jnp.int32)
    pad = jnp.asarray([0, 3])
    positions, mask = prompt_layout(tokens, pad, 12)
    probe = Probe(rows=jnp.asarray([[8, 9], [8, 9]]), weight=jnp.asarray([[0.5, 0.5], [0.0, 1.0]]))
    _, cache, score = jax.jit(lambda m, c: m.forward(tokens, positions, mask, c, jnp.zeros((2,), jnp.int32),
                                                     probe=probe))(lm, lm.init_cache(2, 12))  # eager: 23 s
    cfg, p = lm.cfg, lm.layers[0]
    x = layers.rms_norm(lm.embed[tokens], p["attn_norm"], cfg.norm_eps)
    nh = cfg.n_heads * cfg.head_dim
    q = jnp.einsum("BTD,ED->BTE", x, p["qkv"][:nh])
    if cfg.qkv_bias:
        q = q + p["bqkv"][:nh][None, None]
    inv, scale = layers.rope_inv_freq(cfg.rope, cfg.head_dim)
    q = layers.apply_rope(q.reshape(2, 10, cfg.n_heads, cfg.head_dim), positions, inv, scale)
    k = jnp.repeat(cache.k[0], cfg.n_heads // cfg.n_kv_heads, axis=2)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(cfg.head_dim)
    want = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), -1).mean(1)  # [B, T, S]
    want = np.einsum("bqs,bq->bs", np.asarray(want)[:, 8:10], np.asarray(probe.weight))
    np.testing.assert_allclose(np.asarray(score), want, rtol=1e-4, atol=1e-6)
    assert np.allclose(np.asarray(score).sum(-1), 1.0, atol=1e-5)


@pytest.mark.slow  # 60 s on 2 cores; the text pairs are checked through the kernel in the default suite
def test_pallas_attention_on_a_vlm_pair(tiny_vlm):
    """`--attention pallas` on a Qwen2.5-VL pair (M-RoPE positions, a batch mixing images and a video, the draft's
    prompt pruned to 20% / 10% of the visual tokens and compacted): SAGE equals AR on the XLA path."""
    target = tiny_vlm("qwen2_5_vl", 0, head_dim=64)
    draft = tiny_vlm("qwen2_5_vl", 1, n_layers=1, like=target, noise=0.05, head_dim=64)
    kw = dict(images=IMAGES, videos=VIDEOS, max_new_tokens=16)
    ref = Engine(target, draft).generate(PROMPTS, policy="ar", **kw)
    got = Engine(target, draft, attention="pallas").generate(PROMPTS, policy=TreePolicy.sage(n_max=16, frontier=4),
                                                             **kw)
    assert got.token_ids == ref.token_ids
    assert got.stats.draft_prompt_tokens < got.stats.prompt_tokens and got.stats.mean_accepted > 0
