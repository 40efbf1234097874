"""Speculative output == autoregressive output (greedy, fp32), for every policy, on tiny pairs and the real
SmolLM2, under both matmul paths (on CPU "auto" runs a step's few rows through the skinny kernel, whose columns
are bit-for-bit independent; "xla" is XLA's dot, what TPU and GPU run); and EOS / token limits inside an accepted
path end the sequence exactly where AR ends it."""

import jax
import numpy as np
import pytest

from cpu_kernels.skinny_matmul import build
from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import POLICIES, TreePolicy
from sage_jax.engine import Engine

# Paper-default trees on the tiny pair (cheap); smaller budgets on the 135M target keep the default suite fast.
REAL_POLICIES = {
    "chain": TreePolicy.chain(),
    "static": TreePolicy.static(),
    "eagle2": TreePolicy.eagle2(n_max=16, depth=4),
    "sage": TreePolicy.sage(n_max=16, frontier=4),
}

REAL_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three fruits.",
    "Explain recursion in one sentence.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse.",
    "What is 12 times 7?",
    "Give me a haiku about the sea.",
    "Name the planets of the solar system.",
    "How do I open a file in Python?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


MATMULS = ("auto", "xla")


def _engine(*args, matmul: str, **kw) -> Engine:
    """An engine whose models multiply the `matmul` way; "auto" is skipped where the CPU kernel is unavailable
    (it would be XLA's dot, the "xla" case)."""
    engine = Engine(*args, matmul=matmul, **kw)
    if matmul == "auto" and jax.default_backend() == "cpu" and not build.ready():
        pytest.skip(f"the skinny kernel is unavailable ({build.reason()}): auto would be the xla case")
    return engine


def _assert_tau_counts_committed(gen):
    """τ counts committed tokens: every loop token is a committed draft token or a step's bonus (a last step cut
    at EOS or at the token limit adds only what it committed), and the per-rank counts add up to the same."""
    st = gen.stats
    loop_tokens = st.new_tokens - len(gen.token_ids)  # the prefill gives each row its first token
    assert round(st.mean_accepted * st.row_steps) + st.row_steps == loop_tokens, (st.mean_accepted, st.row_steps)
    assert sum(st.accepted_at) == round(st.mean_accepted * st.row_steps)


@pytest.fixture(scope="module")
def tiny_pair(tiny_lm):
    # EOS = 7 ends some rows early; the draft is a different, smaller random model with the same vocabulary.
    target = tiny_lm(0, vocab_size=64, n_layers=3, eos_token_ids=(7,))
    draft = tiny_lm(1, vocab_size=64, n_layers=1, eos_token_ids=(7,))
    return target, draft


# A compile per policy: XLA's dot takes every policy in the slow tier; in the default suite it is checked by the
# tiny self-draft below and the real pair with its shipped head. Width buckets (`Engine.bucket_ratio`) double a
# loop's compile; the default tier keeps them for SAGE (and the real pair) and runs the other policies at one width.
@pytest.mark.parametrize("matmul", ["auto", pytest.param("xla", marks=pytest.mark.slow)])
def test_tiny_batch_every_policy_matches_ar(tiny_pair, matmul):
    target, draft = tiny_pair
    engine = _engine(target, draft, matmul=matmul)
    one_width = _engine(target, draft, matmul=matmul)
    if matmul == "auto":
        one_width.bucket_ratio = 1
    prompts = [[3, 4, 5, 6, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=40)
    lengths = [len(t) for t in ref.token_ids]
    assert len(set(lengths)) > 1 or any(t[-1] == 7 for t in ref.token_ids), "rows should end differently"
    # The shortest row first, so that row 0 stops while the others decode on (the same buckets: no new compile).
    prompts = [prompts[i] for i in np.argsort(lengths, kind="stable")]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=40)
    assert len(ref.token_ids[0]) < max(map(len, ref.token_ids))
    for name in POLICIES:
        got = (engine if name == "sage" else one_width).generate(prompts, policy=name, max_new_tokens=40)
        assert got.token_ids == ref.token_ids, name
        _assert_tau_counts_committed(got)  # rows end at EOS (7) inside accepted paths
        # τ's trace is row 0's while it decodes: its steps' tokens are row 0's (the acceptance priors' depths).
        taus = got.stats.tau_trace
        assert sum(taus) + len(taus) == len(got.token_ids[0]) - 1, (name, taus)
        assert got.stats.steps < ref.stats.steps or name == "chain", (name, got.stats.steps)


# The token limit does not depend on the matmul: the default suite takes XLA's dot here ("auto" has every policy above).
@pytest.mark.parametrize("matmul", [pytest.param("auto", marks=pytest.mark.slow), "xla"])
def test_tiny_self_draft_and_token_limit(tiny_pair, matmul):
    target, _ = tiny_pair
    engine = _engine(target, draft_spec=DraftSpec(kind="self", n_layers=2), matmul=matmul)
    engine.bucket_ratio = 1  # one width: half the compile (the test above has SAGE's buckets)
    for limit in (1, 6, 16):  # one new-token bucket: no extra compiles
        ref = engine.generate([[3, 4, 5]], policy="ar", max_new_tokens=limit)
        got = engine.generate([[3, 4, 5]], policy="sage", max_new_tokens=limit)
        assert got.token_ids == ref.token_ids
        _assert_tau_counts_committed(got)  # the last step's path runs past the limit
        assert all(len(t) <= limit for t in got.token_ids)


# A compile per policy: 3–9 min on 2 CPU cores. In the default suite the real model is checked with its shipped
# EAGLE head and SAGE (tests/sage_jax/test_api.py); under -m integration through the README's main command too
# (test_generate.py).
@pytest.mark.slow
@pytest.mark.parametrize("matmul", MATMULS)
def test_real_smollm2_every_policy_matches_ar(smollm2, matmul):
    _, model, tok, _ = smollm2
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for p in REAL_PROMPTS]
    engine = _engine(model, draft_spec=DraftSpec(kind="self", n_layers=20), matmul=matmul)
    refs = [engine.generate([p], policy="ar", max_new_tokens=10).token_ids for p in prompts]
    assert any("Paris" in tok.decode(r[0]) for r in refs)
    for name, policy in REAL_POLICIES.items():
        for p, r in zip(prompts, refs, strict=True):
            assert engine.generate([p], policy=policy, max_new_tokens=10).token_ids == r, (name, tok.decode(p))


# A compile of the real model's full SAGE loop (~60 s on 2 cores): under -m integration. The default suite checks XLA's
# dot on the tiny pair (above) and the real pair on "auto" (tests/sage_jax/test_api.py).
@pytest.mark.integration
def test_real_smollm2_sage_with_the_shipped_head_matches_ar_on_xlas_dot(smollm2_path):
    """The README's pair with `--matmul xla`: every verify runs XLA's dot, as on TPU and GPU."""
    from sage_jax.engine import load_engine

    engine = load_engine(matmul="xla")
    assert engine.target_lm.cfg.matmul == "xla"
    prompts = [engine.encode(REAL_PROMPTS[0])]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=12)
    assert engine.generate(prompts, policy="sage", max_new_tokens=12).token_ids == ref.token_ids


# ******** --attention pallas: the decoding loops through the tree-attention kernel (interpreted on CPU). ********


@pytest.fixture(scope="module")
def tiny_pair_64(tiny_lm):
    """The tiny pair at head dim 64, which the kernels take."""
    target = tiny_lm(0, vocab_size=64, n_layers=3, eos_token_ids=(7,), head_dim=64)
    draft = tiny_lm(1, vocab_size=64, n_layers=1, eos_token_ids=(7,), head_dim=64)
    return target, draft


PALLAS_PROMPTS = [[3, 4, 5, 6, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


def _pallas_matches_xla_ar(engine_x, engine_p, prompts, policies, max_new):
    ref = engine_x.generate(prompts, policy="ar", max_new_tokens=max_new)
    for name, policy in policies.items():
        assert engine_p.generate(prompts, policy=policy, max_new_tokens=max_new).token_ids == ref.token_ids, name
    return ref


def test_tiny_pallas_sage_matches_ar(tiny_pair_64):
    """Rows of different lengths in one batch and a separate draft LM: the target's verify, the draft's tree
    levels and its catch-up all run through the kernel."""
    target, draft = tiny_pair_64
    engine_x, engine_p = Engine(target, draft), Engine(target, draft, attention="pallas")
    assert engine_p.target_lm.cfg.attention == "pallas" and engine_p.draft.cfg.attention == "pallas"
    _pallas_matches_xla_ar(engine_x, engine_p, PALLAS_PROMPTS, {"sage": "sage"}, 24)
    compiles = engine_p.compiles
    other = [[21, 22], [23, 24, 25, 26], [27, 28, 29, 30, 31, 32, 33]]  # other lengths, the same bucket
    want = engine_x.generate(other, policy="ar", max_new_tokens=24).token_ids
    assert engine_p.generate(other, policy="sage", max_new_tokens=24).token_ids == want
    assert engine_p.compiles == compiles  # no recompile through the kernel path either


@pytest.mark.slow
def test_tiny_pallas_every_policy_matches_ar(tiny_pair_64):
    """Every policy, and a self-draft of the target's first 2 layers, whose high acceptance commits deep paths."""
    target, draft = tiny_pair_64
    engine_x, engine_p = Engine(target, draft), Engine(target, draft, attention="pallas")
    ref = _pallas_matches_xla_ar(engine_x, engine_p, PALLAS_PROMPTS, {"ar": "ar", **{n: n for n in POLICIES}}, 40)
    self_p = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=2), attention="pallas")
    got = self_p.generate(PALLAS_PROMPTS, policy="sage", max_new_tokens=40)
    assert got.token_ids == ref.token_ids and got.stats.mean_accepted > 0.5


# The interpreted kernel at SmolLM2's size (30 layers); the default suite runs it on the tiny pair above.
@pytest.mark.integration
def test_real_smollm2_pallas_sage_with_the_shipped_head(smollm2_path):
    """The README's pair (SmolLM2-135M-Instruct and its shipped EAGLE head) through the kernel: SAGE with a
    retrieval chain merged into every tree equals plain greedy decoding on the XLA path."""
    from sage_jax.engine import load_engine

    engine_x = load_engine()
    engine_p = load_engine(attention="pallas")
    prompts = [engine_x.encode(REAL_PROMPTS[0])]
    _pallas_matches_xla_ar(engine_x, engine_p, prompts, {"sage": TreePolicy.sage(retrieval=8)}, 12)


@pytest.mark.slow
def test_real_smollm2_pallas_every_policy_matches_ar(smollm2_path):
    from sage_jax.engine import load_engine

    engine_x, engine_p = load_engine(), load_engine(attention="pallas")
    prompts = [engine_x.encode(p) for p in REAL_PROMPTS[:4]]
    policies = {"ar": "ar", **{n: TreePolicy.named(n) for n in POLICIES}}
    ref = _pallas_matches_xla_ar(engine_x, engine_p, prompts, policies, 24)
    assert "Paris" in engine_x.tokenizer.decode(ref.token_ids[0])


# ******** --matmul exact: in bfloat16, SAGE's full trees equal plain decoding bit for bit. ********


def _exact_bf16_matches_ar(prompts: list[str], max_new_tokens: int):
    from sage_jax.engine import load_engine

    engine = load_engine(dtype="bfloat16", matmul="exact")
    steps_ar = steps_sage = 0
    for p in prompts:
        ar = engine.generate([p], policy="ar", max_new_tokens=max_new_tokens)
        sage = engine.generate([p], policy="sage", budget=None, max_new_tokens=max_new_tokens)
        assert sage.token_ids == ar.token_ids, p
        steps_ar, steps_sage = steps_ar + ar.stats.steps, steps_sage + sage.stats.steps
    assert steps_sage < steps_ar / 1.5  # the trees were accepted deep, not only at their roots


# The real SmolLM2 and its shipped head in bfloat16 with full trees, on `EVAL_PROMPTS[8]`: with one width bucket
# (`Engine.bucket_ratio = 1`: every verify at the full tree's 65 rows against AR's one, one compiled copy of each
# forward) XLA's dot makes SAGE leave AR there at token 9; these are the exact mode's tokens on one device. The
# integration test below derives both facts afresh.
EXACT_PROMPT, EXACT_TOKENS = 8, [788, 2583, 6256, 28, 253, 980, 284, 253, 6566, 359, 827, 4073]


def _exact_engine(**kw):
    from sage_jax.engine import load_engine

    engine = load_engine(dtype="bfloat16", **kw)
    engine.bucket_ratio = 1
    return engine


# A loop in the exact mode compiles for one to two minutes on two cores (30 unrolled layers, the kernels' jnp
# references), so the default tier runs SAGE on one mesh; the integration test below runs AR and SAGE on both.
def test_real_smollm2_bf16_exact_sage_on_a_4_way_mesh_gives_the_one_device_tokens(devices):
    """The target cut 4 ways (its MLP; 9 query / 3 kv heads leave attention whole on each device): SAGE's full
    trees give the one-device exact AR tokens, accepted deep."""
    from configs import sharding
    from sage_jax.prompts import EVAL_PROMPTS

    placed = _exact_engine(matmul="exact", mesh=sharding.make_mesh(data=1, model=4, devices=devices[:4]))
    assert placed.target_lm.groups == (1, 4)
    ids = [placed.encode(EVAL_PROMPTS[EXACT_PROMPT][1])]
    got = placed.generate(ids, policy="sage", budget=None, max_new_tokens=len(EXACT_TOKENS))
    assert got.token_ids == [EXACT_TOKENS]
    assert got.stats.steps < len(EXACT_TOKENS) / 1.5


@pytest.mark.integration
def test_real_smollm2_bf16_exact_is_the_same_on_2_and_4_way_meshes(devices):
    """The default tier's check in full: XLA's dot makes SAGE leave AR on this prompt, the one-device exact AR
    gives `EXACT_TOKENS`, and AR and SAGE both give them with the target cut 2 and 4 ways. About 5 minutes here,
    nearly all of it the exact mode's compiles."""
    from configs import sharding
    from sage_jax.prompts import EVAL_PROMPTS

    prompt, n = EVAL_PROMPTS[EXACT_PROMPT][1], len(EXACT_TOKENS)
    fast = _exact_engine(matmul="xla")
    ids = [fast.encode(prompt)]
    assert (fast.generate(ids, policy="sage", budget=None, max_new_tokens=n).token_ids
            != fast.generate(ids, policy="ar", max_new_tokens=n).token_ids)
    assert _exact_engine(matmul="exact").generate(ids, policy="ar", max_new_tokens=n).token_ids == [EXACT_TOKENS]
    for ways in (2, 4):
        placed = _exact_engine(matmul="exact", mesh=sharding.make_mesh(data=1, model=ways, devices=devices[:ways]))
        assert placed.target_lm.groups == (1, ways)
        for policy in ("ar", "sage"):
            got = placed.generate(ids, policy=policy, budget=None, max_new_tokens=n)
            assert got.token_ids == [EXACT_TOKENS], (ways, policy)
            assert policy == "ar" or got.stats.steps < n / 1.5  # the trees were accepted deep


# The default suite runs the real SmolLM2 in the exact mode on meshes against the one-device tokens (above).
@pytest.mark.integration
def test_real_smollm2_bf16_exact_sage_matches_ar_on_24_prompts():
    """Among them the prompts on which, in bfloat16 with XLA's dot, SAGE's output leaves AR's at tokens 11-80
    (benchmarks/sage/results/readme/bf16_agreement.json); the exact mode keeps all 24 equal."""
    from sage_jax.prompts import EVAL_PROMPTS

    _exact_bf16_matches_ar([p for _, p in EVAL_PROMPTS[:24]], 96)
