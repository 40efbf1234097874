"""The separate draft VLM: pruned rows, its loss, its checkpoint around the default target's LM, and SAGE with it."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import checkpoint
from sage_jax.decoding.visual_pruning import keep_counts
from sage_jax.models import llava_onevision as lo
from sage_jax.models import serving_lm
from sage_jax.training import loop, vlm_data, vlm_draft, vlm_head, vlm_model, vlm_stages
from sage_jax.training.vlm_recipe import DraftVLMRecipe, StageConfig

from .test_vlm_stages import _tiny_parts


@pytest.fixture(scope="module")
def tok():
    from sage_jax.io import loader

    return vlm_model.tokenizer(loader.load_lm(loader.default_target())[2])


@pytest.fixture(scope="module")
def tiny(tok):
    """Tiny parts, a random target VLM around them, its answers to 8 images, and a 1-layer draft recipe."""
    parts = _tiny_parts(tok)
    own = vlm_stages.init_params(parts.cfg, 0)
    images = parts.data["fashion"].pixels[:8]
    rows = vlm_head.answer_rows(parts, own, images, [vlm_data.DEFAULT_QUESTION] * 8, max_new=6, batch=8)
    c = DraftVLMRecipe(tower_layers=1, lm_layers=1, rows=8, heldout_rows=8, max_new_tokens=6,
                       train=StageConfig(steps=8, batch_size=4, lr=3e-3, warmup=0, ckpt_every=4))
    return parts, own, rows, c


def test_keep_mask_keeps_what_decoding_keeps(tiny):
    parts, _, rows, _ = tiny
    img = parts.cfg.image_token_id
    n_vis = int((rows["tokens"][0] == img).sum())
    ratios = np.asarray([0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.8, 0.0])
    keep = vlm_draft.keep_mask(rows["tokens"], img, ratios, np.random.default_rng(0))
    text = rows["tokens"] != img
    assert (keep | ~text).all()  # every text slot is seen
    assert [int((keep & ~text)[i].sum()) for i in range(8)] == [keep_counts(n_vis, 0, (r, 0.0))[0] for r in ratios]


def test_a_pruned_row_is_the_compacted_prompt_decoding_runs(tiny):
    """Masking the pruned visual slots out (training) gives the logits of the compacted prompt with the target's
    positions (decoding's draft prompt), up to float32 rounding."""
    parts, own, rows, c = tiny
    dcfg = vlm_draft.config(c, parts.cfg)
    params = vlm_draft.init_params(c, parts, own)
    fz = {"embed": parts.lm_serving.embed}
    targets = vlm_draft.answer_targets(rows, c.max_new_tokens)
    idx = np.arange(1)
    keep = vlm_draft.keep_mask(rows["tokens"][idx], dcfg.image_token_id, np.asarray([0.8]),
                               np.random.default_rng(1))
    b = vlm_draft.batch(rows, targets, idx, keep)
    masked = np.asarray(vlm_draft.logits(dcfg, params, fz, b))
    n, t = b["tokens"].shape
    slots = jnp.nonzero(b["tokens"].reshape(-1) == dcfg.image_token_id, size=n * vlm_model.n_visual(dcfg))[0]
    x = lo.embed_inputs(dcfg, vlm_model.plan(dcfg, n), {**{k: params[k] for k in ("vision", "projector",
                                                                                  "image_newline")},
                                                        "lm": {"embed": fz["embed"]}},
                        b["tokens"], b["tiles"], None, slots.astype(jnp.int32), None)
    lm = serving_lm.serving_params(dcfg.text, {"embed": fz["embed"], "blocks": params["blocks"],
                                               "final_norm": params["final_norm"]})
    positions = np.maximum(np.cumsum(b["valid"], axis=1) - 1, 0)
    for i in range(n):
        seen = np.flatnonzero(b["valid"][i] & keep[i])
        m = len(seen)
        mask = jnp.tril(jnp.ones((m, m), bool))[None]
        h, _ = lm.forward(None, jnp.asarray(positions[i, seen][None], jnp.int32), mask,
                          embeddings=x[i: i + 1, seen])
        at = np.searchsorted(seen, b["where"][i])  # the answer slots in the compacted row
        np.testing.assert_allclose(np.asarray(lm.head(h[:, at]))[0], masked[i], rtol=2e-4, atol=2e-4)


@pytest.mark.integration  # ~10 s; the real pair's clip runs in the default tier (the last test here)
def test_a_pruned_clip_row_sees_what_it_keeps_and_its_frames(tok):
    """A video target's clip rows: the target's answers to 2 clips, the draft's batch carries the frames, every
    video slot is visual to `keep_mask` (kept at the ratio), and the pruned logits equal those of the compacted
    prompt (the frames' features of the kept slots only), up to float32 rounding."""
    parts = _tiny_parts(tok)
    parts = dataclasses.replace(parts, cfg=dataclasses.replace(parts.cfg, video_token_id=vlm_model.VIDEO_TOKEN_ID))
    own = vlm_stages.init_params(parts.cfg, 0)
    clips = np.stack([vlm_data.draw_clip(parts.data["fashion"], np.random.default_rng(i))[0] for i in range(2)])
    rows = vlm_head.answer_rows(parts, own, clips, [vlm_data.VIDEO_QUESTION] * 2, max_new=4, batch=2)
    assert "clips" in rows and (rows["tokens"] == vlm_model.VIDEO_TOKEN_ID).sum(axis=1).tolist() == [97, 97]
    c = DraftVLMRecipe(tower_layers=1, lm_layers=1, max_new_tokens=4, train=StageConfig(steps=1, batch_size=2, lr=0))
    dcfg = vlm_draft.config(c, parts.cfg)
    params = vlm_draft.init_params(c, parts, own)
    fz = {"embed": parts.lm_serving.embed}
    targets = vlm_draft.answer_targets(rows, 4)
    idx = np.arange(2)
    keep = vlm_draft.keep_mask(rows["tokens"], vlm_draft.visual_ids(dcfg), np.asarray([0.9, 0.0]),
                               np.random.default_rng(1))
    assert ((rows["tokens"] == vlm_model.VIDEO_TOKEN_ID) & keep).sum(axis=1).tolist() == [
        keep_counts(0, 97, (0.0, 0.9))[1], 97]
    b = vlm_draft.batch(rows, targets, idx, keep)
    assert b["frames"].shape == (2, 24, 3, 28, 28) and b["tiles"].shape[0] == 0
    masked = np.asarray(vlm_draft.logits(dcfg, params, fz, b))
    plan, tiles, frames, islots, vslots = vlm_model.visual_inputs(dcfg, jnp.asarray(b["tokens"]), b["tiles"],
                                                                  b["frames"])
    x = lo.embed_inputs(dcfg, plan, {**{k: params[k] for k in ("vision", "projector", "image_newline")},
                                     "lm": {"embed": fz["embed"]}}, b["tokens"], tiles, frames, islots, vslots)
    lm = serving_lm.serving_params(dcfg.text, {"embed": fz["embed"], "blocks": params["blocks"],
                                               "final_norm": params["final_norm"]})
    positions = np.maximum(np.cumsum(b["valid"], axis=1) - 1, 0)
    for i in range(2):
        seen = np.flatnonzero(b["valid"][i] & keep[i])
        m = len(seen)
        h, _ = lm.forward(None, jnp.asarray(positions[i, seen][None], jnp.int32),
                          jnp.tril(jnp.ones((m, m), bool))[None], embeddings=x[i: i + 1, seen])
        at = np.searchsorted(seen, b["where"][i])
        np.testing.assert_allclose(np.asarray(lm.head(h[:, at]))[0], masked[i], rtol=2e-4, atol=2e-4)


@pytest.mark.integration  # 15-30 s; the shipped draft's own layers load in the default tier
def test_training_lowers_the_loss_and_resumes(tiny, tmp_path):
    parts, own, rows, c = tiny
    dcfg = vlm_draft.config(c, parts.cfg)
    targets = vlm_draft.answer_targets(rows, c.max_new_tokens)
    fz = {"embed": parts.lm_serving.embed}

    def batch_fn(step):
        rng = np.random.default_rng([0, step])
        idx = rng.integers(8, size=4)
        return vlm_draft.batch(rows, targets, idx, vlm_draft.keep_mask(rows["tokens"][idx], dcfg.image_token_id,
                                                                       rng.choice(c.ratios, size=4), rng))

    p0 = vlm_draft.init_params(c, parts, own)
    res = loop.stage("draft_vlm", c.train, p0, lambda p, f, b: vlm_draft.loss(dcfg, p, f, b), batch_fn,
                     str(tmp_path), frozen=fz, progress=False)
    first = float(vlm_draft.loss(dcfg, p0, fz, batch_fn(0))[0])
    assert float(vlm_draft.loss(dcfg, res.params, fz, batch_fn(0))[0]) < first
    assert vlm_draft.agreement(dcfg, res.params, fz, rows, targets, 0.8, 0, size=4) >= 0.0


@pytest.mark.integration  # 15-30 s; the shipped draft's own layers load in the default tier
def test_the_draft_checkpoint_keeps_its_own_layers_around_the_default_lm(tiny, tmp_path):
    """`save_adapter` with `params["lm"]`: only the draft's own layers and final norm are stored; loading puts
    them under the given language model's embedding, in module and in serving form alike; a draft with more
    layers than that language model is refused in one line."""
    from sage_jax.io import vlm_checkpoint

    parts, own, _, c = tiny
    dcfg = vlm_draft.config(c, parts.cfg)
    params = jax.tree.map(lambda x: np.asarray(x) + 0.01, vlm_draft.init_params(c, parts, own))  # not the target's
    (tmp_path / "target").mkdir()  # what the provenance names
    path = vlm_draft.export(c, dcfg, parts, params, str(tmp_path / "draft"), str(tmp_path / "target"))
    meta = checkpoint.read_metadata(path)
    assert vlm_checkpoint.own_lm(path) and sorted(k for k in meta["params"] if k.startswith("lm/"))
    assert not any(k.startswith("lm/embed") for k in meta["params"])
    decoder = vlm_draft_decoder(parts)
    _, cfg, module = vlm_checkpoint.load_checkpoint(path, language_model=(parts.cfg.text, decoder))
    assert cfg.text.n_layers == 1 and cfg.vision.num_layers == 1
    got = module.lm.params()
    np.testing.assert_array_equal(np.asarray(got["blocks"]["wq"]), params["blocks"]["wq"])
    np.testing.assert_array_equal(np.asarray(got["embed"]), np.asarray(parts.lm_params["embed"]))
    _, _, _, lm = vlm_checkpoint.load_serving(path, language_model=parts.lm_serving)
    want = serving_lm.serving_params(dcfg.text, {"embed": parts.lm_serving.embed, "blocks": params["blocks"],
                                                 "final_norm": params["final_norm"]})
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((4, 4), bool))[None]
    np.testing.assert_allclose(np.asarray(lm.forward(tokens, pos, mask)[0]), np.asarray(want.forward(tokens, pos,
                                                                                                     mask)[0]),
                               rtol=1e-6, atol=1e-6)
    deeper = vlm_draft.export(c, dataclasses.replace(dcfg, text=dcfg.text.replace(n_layers=3)), parts, params,
                              str(tmp_path / "deeper"), str(tmp_path / "target"))
    with pytest.raises(checkpoint.CheckpointError, match="another language model"):
        vlm_checkpoint.load_serving(deeper, language_model=parts.lm_serving)


def vlm_draft_decoder(parts):
    from flax import nnx

    from sage_jax.models.decoder import Decoder

    d = Decoder(parts.cfg.text, rngs=nnx.Rngs(0))
    nnx.replace_by_pure_dict(nnx.state(d, nnx.Param), parts.lm_params)
    return d


@pytest.mark.integration
def test_sage_with_a_draft_vlm_cut_from_the_shipped_vlm_equals_ar(tmp_path):
    """The real pair: the shipped VLM and a draft cut from it (2 tower layers, 2 LM layers, untrained) through
    `load_engine`: SAGE's answer to a held-out image is AR's, at pruning ratios 0 and 0.8."""
    from sage_jax.engine import load_engine
    from sage_jax.io import loader

    c = DraftVLMRecipe(train=StageConfig(steps=1, batch_size=1, lr=1e-3))
    path, parts, own = vlm_draft.target(c)
    dcfg = vlm_draft.config(c, parts.cfg)
    draft = vlm_draft.export(c, dcfg, parts, vlm_draft.init_params(c, parts, own), str(tmp_path / "draft"), path)
    image = os.path.join(tmp_path, "x.png")
    from PIL import Image

    Image.fromarray(vlm_draft.heldout_images(1)[0]).save(image)
    eng = load_engine(loader.default_vlm(), draft)
    ar = eng.generate(["What is in this image?"], images=[[image]], policy="ar", max_new_tokens=12)
    for ratio in (0.0, 0.8):
        sage = eng.generate(["What is in this image?"], images=[[image]], policy="sage", max_new_tokens=12,
                            prune_ratio=ratio)
        assert sage.token_ids == ar.token_ids


#: The draft VLM the shipped one was fine-tuned from (`init`): the recipe on images alone, distilled from the VLM
#: before its video stage.
IMAGE_DRAFT_SHA256 = "e8901b9624495999298c10a3587c02aa9f7f04847b76c48d994199cf49b29b1c"


def test_the_shipped_draft_vlm_is_its_recipes():
    """`sage_jax/assets/smollm2_vlm_draft` records the recipe that made it, `configs/sage/smollm2_vlm_draft.py`
    as it stands (with the `init` and shorter schedule of its second run, the recipe's docstring), and the sha256
    of the shipped VLM it was distilled from; it is the shipped VLM's default draft."""
    from configs import provenance
    from configs.sage import smollm2_vlm_draft
    from sage_jax.io import loader

    meta = checkpoint.read_metadata(loader.DEFAULT_VLM_DRAFT)
    recipe = DraftVLMRecipe.from_config(smollm2_vlm_draft.get_config())
    shipped = meta["provenance"]["recipe"]
    assert meta["provenance"]["init_sha256"] == IMAGE_DRAFT_SHA256
    second_run = {"init": shipped["init"], "train": {**recipe.to_json()["train"], "steps": 400, "warmup": 20}}
    assert shipped == json_round_trip(recipe.to_json() | second_run)
    assert meta["provenance"]["target_sha256"] == provenance.checkpoint_sha256(loader.default_vlm())
    assert meta["config"]["model"]["text"]["n_layers"] == recipe.lm_layers
    assert meta["config"]["model"]["vision"]["num_layers"] == recipe.tower_layers
    assert loader.default_vlm_draft() == loader.DEFAULT_VLM_DRAFT


def json_round_trip(x):
    import json

    return json.loads(json.dumps(x))


def test_the_shipped_draft_vlm_keeps_accepting_when_pruned():
    """The paper's claim on the real pair (the shipped VLM and its draft VLM): on a held-out image and a held-out
    clip in one batch, SAGE (its trees within 8 nodes) with the draft seeing a fifth of the image's tokens and a tenth
    of the clip's equals AR, accepts, and names the clip's items; on the committed Table 5 of this very draft (64
    images, 32 clips, full trees, both selections), τ at a pruning ratio of 0.8 is within 10% of τ with every visual
    token, every output equalled AR's, and on clips the draft's prefill at 0.8 costs at most 35% of its FLOPs at 0; the
    table's runs of the shipped EAGLE head are of this head, at every ratio, every output AR's."""
    import json

    from PIL import Image

    from configs import provenance
    from sage_jax.decoding.policies import TreePolicy
    from sage_jax.engine import load_engine
    from sage_jax.io import loader

    engine = load_engine(loader.default_vlm())
    clips, labels = vlm_data.heldout_clips(1)
    prompts = [vlm_data.DEFAULT_QUESTION, vlm_data.VIDEO_QUESTION]
    kw = dict(images=[[Image.fromarray(vlm_draft.heldout_images(1)[0])], []], videos=[[], [clips[0]]],
              max_new_tokens=16)
    ar = engine.generate(prompts, policy="ar", **kw)
    small = TreePolicy.sage().fitted(8, 5)  # SAGE's trees within 8 nodes: a smaller program to compile
    sage = engine.generate(prompts, policy=small, budget=(8, 5), prune_ratio=(0.8, 0.9), **kw)
    assert sage.token_ids == ar.token_ids
    assert sage.stats.draft_prompt_tokens < sage.stats.prompt_tokens and sage.stats.mean_accepted >= 2.0
    assert vlm_data.classes_named(ar.text[1]) == set(labels[0].tolist()), ar.text[1]
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "sage", "results", "vlm_table5")
    for run in ("draft_vlm_attention", "draft_vlm_uniform", "clips_draft_vlm_attention", "clips_draft_vlm_uniform"):
        with open(os.path.join(root, run, "vlm_bench.json")) as f:
            out = json.load(f)
        assert out["provenance"]["draft_sha256"] == provenance.checkpoint_sha256(loader.DEFAULT_VLM_DRAFT)
        sweep = {r["ratio"]: r for r in out["sweep"]}
        assert sweep[0.8]["tau"] >= 0.9 * sweep[0.0]["tau"] and all(r["same_as_ar"] for r in out["sweep"]), run
        if run.startswith("clips"):
            assert sweep[0.8]["draft_prefill_gflops"] <= 0.35 * sweep[0.0]["draft_prefill_gflops"], run
    for run in ("eagle_attention", "eagle_uniform", "clips_eagle_attention", "clips_eagle_uniform"):  # the head's
        with open(os.path.join(root, run, "vlm_bench.json")) as f:
            out = json.load(f)
        assert out["provenance"]["draft_sha256"] == provenance.checkpoint_sha256(loader.vlm_head_draft()), run
        assert [r["ratio"] for r in out["sweep"]] == [0.0, 0.3, 0.6, 0.8, 0.9, 0.95], run
        assert all(r["same_as_ar"] for r in out["sweep"]), run
