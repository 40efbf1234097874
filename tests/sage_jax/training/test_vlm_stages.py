"""The home-trained VLM's pieces: data templates, tokenizer, pixel path, warm start, resumable stages, export."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

from configs import checkpoint
from configs.datasets import FASHION_MNIST_DIR
from sage_jax.models.config import LMConfig, RopeConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.siglip import SiglipConfig
from sage_jax.training import loop, vlm_data, vlm_model, vlm_stages
from sage_jax.training.vlm_recipe import StageConfig, VLMRecipe

#: The VLM of the recipe's tower and align stages (shipped before the video stage), which the video stage started from.
IMAGE_STAGES_SHA256 = "396cd9c089a84995f4248023183991fd4e80d8715bf7eee5b08ed3b4fc0ac747"
needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION_MNIST_DIR), reason="dataset-fashion-mnist missing")


@pytest.fixture(scope="module")
def text_tokenizer():
    from sage_jax.io import loader

    return loader.load_lm(loader.default_target())[2]


@pytest.fixture(scope="module")
def tok(text_tokenizer):
    return vlm_model.tokenizer(text_tokenizer)


def test_class_named_reads_one_class_back():
    assert vlm_data.class_named("The image shows a t-shirt.") == 0
    assert vlm_data.class_named("The image shows a shirt.") == 6
    assert vlm_data.class_named("A pair of trousers.") == 1
    assert vlm_data.class_named("Ankle boot.") == 9
    assert vlm_data.class_named("It is a sneaker, not a sandal.") is None  # two classes named: not an answer
    assert vlm_data.class_named("I cannot tell.") is None


def test_every_fashion_answer_names_its_class():
    rng = np.random.default_rng(0)
    for label in range(10):
        for _ in range(40):
            q, a = vlm_data.question_answer("fashion", label, rng)
            assert vlm_data.class_named(a) == label, (q, a)


def test_tokenizer_renames_only_the_placeholder(text_tokenizer, tok):
    text = "def f(x):\n    return x ** 2  # The image shows a sneaker. <|im_end|>"
    assert tok(text)["input_ids"] == text_tokenizer(text)["input_ids"]
    assert tok("<image>")["input_ids"] == [vlm_model.IMAGE_TOKEN_ID]
    assert len(tok) == len(text_tokenizer) == 49152
    msgs = [{"role": "user", "content": "Hello there"}]
    assert (tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == text_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    img = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert "<|im_start|>user\n<image>\nWhat is this?<|im_end|>" in tok.apply_chat_template(img, tokenize=False)


def test_the_video_placeholder_is_its_own_token(text_tokenizer, tok):
    assert tok("<video>")["input_ids"] == [vlm_model.VIDEO_TOKEN_ID]
    assert tok("<jupyter_script>")["input_ids"] != [vlm_model.VIDEO_TOKEN_ID]
    vid = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What is in this video?"}]}]
    assert "<|im_start|>user\n<video>\nWhat is in this video?<|im_end|>" in tok.apply_chat_template(vid, tokenize=False)


def test_a_clip_shows_its_items_in_turn_and_its_answer_names_them():
    rng = np.random.default_rng(0)
    items = rng.integers(1, 255, (3, 28, 28, 3), dtype=np.uint8)
    frames = vlm_data.clip(items, 8)
    assert frames.shape == (24, 28, 28, 3) and frames.dtype == np.uint8
    assert all(not np.array_equal(frames[i], frames[i + 1]) for i in range(23))  # it moves: no two frames repeat
    np.testing.assert_array_equal(frames[4], items[0])  # mid-way through its frames an item sits where it was
    np.testing.assert_array_equal(frames[8 + 5][:, 1:], items[1][:, :-1])  # then slides one pixel a frame
    assert vlm_data.clip_answer([5, 9, 6]) == "A sandal, an ankle boot and a shirt."
    assert vlm_data.clip_answer([1]) == "A pair of trousers."
    for _ in range(200):
        labels = rng.choice(10, size=3, replace=False)
        assert vlm_data.classes_named(vlm_data.clip_answer(labels)) == set(labels.tolist())


@needs_fashion
def test_heldout_clips_come_from_the_test_split_and_round_trip_a_gif(tmp_path):
    from sage_jax.io.images import load_frames

    test = vlm_data.fashion("test")
    frames, labels = vlm_data.heldout_clips(3, test=test)
    later, _ = vlm_data.heldout_clips(2, start=1, test=test)
    np.testing.assert_array_equal(frames[1:], later)  # clip i is the same wherever a range starts
    assert all(len(set(y.tolist())) == 3 for y in labels)
    mid = frames[:, 4::8]  # each item unshifted
    for clip_items, y in zip(mid, labels, strict=True):
        for item, k in zip(clip_items, y, strict=True):
            rows = np.flatnonzero(test.labels == k)
            assert any(np.array_equal(item, test.pixels[r]) for r in rows)
    assert vlm_data.write_clip(str(tmp_path / "clip.gif"), 2) == [vlm_data.FASHION[k] for k in labels[2]]
    np.testing.assert_array_equal(load_frames(tmp_path / "clip.gif"), frames[2])


@needs_fashion
def test_fast_pixels_equal_the_image_processor(tmp_path):
    from PIL import Image

    from sage_jax.io.vision_lm import _image_processor

    images = vlm_data.fashion("test").pixels[vlm_data.heldout_indices(5)]
    ip = _image_processor(vlm_model.write_processor(tmp_path))
    out = ip(images=[Image.fromarray(x) for x in images], return_tensors="np")
    np.testing.assert_array_equal(out["pixel_values"], vlm_model.pixels(images))


@needs_fashion
def test_heldout_images_are_the_test_split_only():
    idx = vlm_data.heldout_indices(100)
    assert len(set(idx.tolist())) == 100 and idx.max() < 10_000
    np.testing.assert_array_equal(idx[:10], vlm_data.heldout_indices(10))  # a prefix: 8 bench images ⊂ 100
    assert vlm_data.heldout_indices(5000, "dev").max() < vlm_data.DEV_ROWS


def test_the_dev_split_is_train_rows_that_no_stage_reads():
    """Fashion-MNIST's train split is cut in two: "train" (what every stage and both drafts draw from) and "dev"
    (its last rows, where training-time evaluations look and settings are chosen); dev clips show dev images."""
    from configs import datasets

    full = datasets.load_fashion_mnist("train")
    train, dev = vlm_data.fashion("train"), vlm_data.fashion("dev")
    assert len(train) + len(dev) == len(full.labels) and len(dev) == vlm_data.DEV_ROWS
    np.testing.assert_array_equal(np.concatenate([train.labels, dev.labels]), full.labels)
    assert not np.array_equal(train.pixels[-1], dev.pixels[0])
    import inspect

    from sage_jax.training import vlm_draft

    for fn in (vlm_model.load_parts, vlm_draft.target):  # what the stages and the draft VLM train on
        assert 'fashion("train")' in inspect.getsource(fn) and '"dev"' not in inspect.getsource(fn)
    frames, labels = vlm_data.heldout_clips(2, split="dev")
    middle = frames[:, vlm_data.FRAMES_PER_ITEM // 2:: vlm_data.FRAMES_PER_ITEM]  # each item unshifted
    seen = {x.tobytes(): k for x, k in zip(dev.pixels, dev.labels, strict=True)}
    assert [[seen[x.tobytes()] for x in clip] for clip in middle] == labels.tolist()
    with pytest.raises(ValueError, match="split"):
        vlm_data.fashion("validation")


# --------------------------------------------------------------------- stages on a tiny language model


def _tiny_parts(tok) -> vlm_model.Parts:
    """A 2-layer random LM of SmolLM2's vocabulary, and images whose class is a random 7x7 pattern repeated over
    the 4x4 patches (so that a random tower's patch features already tell the classes apart linearly)."""
    text = LMConfig(vocab_size=49152, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                    rope=RopeConfig(theta=1e4), tie_embeddings=True, eos_token_ids=(2,), pad_token_id=2,
                    max_position=512)
    decoder = Decoder(text, rngs=__import__("flax").nnx.Rngs(0))
    vision = SiglipConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, image_size=28,
                          patch_size=7)
    rng = np.random.default_rng(0)

    def images(source, n_cls, n):
        labels = rng.integers(n_cls, size=n).astype(np.int32)
        tiles = np.tile(rng.integers(0, 200, (n_cls, 7, 7, 3)), (1, 4, 4, 1))
        px = (tiles[labels] + rng.integers(0, 20, (n, 28, 28, 3))).astype(np.uint8)
        return vlm_data.Images(px, source, labels)

    data = {"fashion": images("fashion", 10, 64), "digits": images("digits", 10, 32),
            "photos": images("photos", len(vlm_data.PHOTOS), 16)}
    return vlm_model.Parts(cfg=vlm_model.config(text, vision), lm_params=decoder.params(),
                           lm_serving=decoder.serving(), tokenizer=tok, data=data)


def _recipe(parts) -> VLMRecipe:
    return VLMRecipe(vision=parts.cfg.vision, tower=StageConfig(steps=4, batch_size=8, lr=1e-3, ckpt_every=2),
                     align=StageConfig(steps=4, batch_size=2, lr=1e-3, ckpt_every=2), ridge_images=64)


def test_warm_start_aims_each_image_at_its_class_word(tok):
    parts = dataclasses.replace(_tiny_parts(tok))
    parts.data = {"fashion": parts.data["fashion"]}  # one source: brightness alone decides the class
    c = _recipe(parts)
    params = vlm_stages.warm_projector(c, parts, vlm_stages.init_params(parts.cfg, 0))
    fashion = parts.data["fashion"]
    feats = np.asarray(vlm_stages.lo._tile_features(parts.cfg, params, vlm_model.pixels(fashion.pixels)[:, 0]))
    embed = np.asarray(parts.lm_serving.embed)
    words = np.stack([embed[tok(w, add_special_tokens=False)["input_ids"]].mean(0)
                      for w in vlm_data.SHORT_NAMES["fashion"]])
    nearest = np.argmin(((feats.mean(axis=1)[:, None] - words[None]) ** 2).sum(-1), axis=1)
    assert np.mean(nearest == fashion.labels) >= 0.9
    newline = embed[tok("\n")["input_ids"]].mean(0)
    np.testing.assert_allclose(params["image_newline"], newline, rtol=1e-6)


def test_cutmix_pastes_whole_patches_and_labels_each_token_by_its_source():
    """Each mixed row takes one box of whole patches (never all of them) from one other row; every token's label
    is the label of the row its patch came from, in the tower's row-major patch order."""
    m, g, patch = 64, 4, 7
    pixels = np.broadcast_to(np.arange(m, dtype=np.float32)[:, None, None, None], (m, 3, 28, 28))
    labels = np.arange(m, dtype=np.int32) + 100  # a row's label names the row
    out, tokens = vlm_stages.cutmix(pixels, labels, 0.5, patch, np.random.default_rng(0))
    assert tokens.shape == (m, g * g) and out.shape == pixels.shape
    src = out[:, 0].reshape(m, g, patch, g, patch).transpose(0, 1, 3, 2, 4).reshape(m, g * g, patch * patch)
    assert (src == src[..., :1]).all()  # each patch comes whole from one row
    np.testing.assert_array_equal(tokens, src[..., 0].astype(np.int32) + 100)
    mixed = (tokens != labels[:, None]).any(axis=1)
    assert 16 <= mixed.sum() <= 48 and (tokens != labels[:, None]).sum(axis=1).max() <= (g - 1) ** 2
    assert all(len(set(t)) <= 2 for t in tokens.tolist())
    same, tokens0 = vlm_stages.cutmix(pixels, labels, 0.0, patch, np.random.default_rng(0))
    np.testing.assert_array_equal(same, pixels)
    np.testing.assert_array_equal(tokens0, np.repeat(labels[:, None], g * g, axis=1))


def test_tower_batch_with_cutmix_and_its_loss(tok):
    """Off by default (the shipped recipe's batches and loss unchanged); on, the batch carries every token's label
    and the loss of unmixed token labels is the plain one."""
    parts = _tiny_parts(tok)
    c = _recipe(parts)
    plain = vlm_stages.tower_batch(c, parts.data, 3, 8)
    assert "token_labels" not in plain
    mixed = vlm_stages.tower_batch(dataclasses.replace(c, cutmix=1.0), parts.data, 3, 8)
    np.testing.assert_array_equal(mixed["labels"], plain["labels"])
    assert (mixed["token_labels"] != plain["labels"][:, None]).any(axis=1).sum() >= 4
    params = {"vision": vlm_stages.init_params(parts.cfg, 0)["vision"],
              "probe": {"w": jax.random.normal(jax.random.key(0), (32, vlm_stages.N_PROBE)),
                        "b": np.zeros(vlm_stages.N_PROBE, np.float32)}}
    as_tokens = {**plain, "token_labels": np.repeat(plain["labels"][:, None], 16, axis=1)}
    want, _ = vlm_stages.tower_loss(parts.cfg, params, plain, 1.0)
    got, _ = vlm_stages.tower_loss(parts.cfg, params, as_tokens, 1.0)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    other, _ = vlm_stages.tower_loss(parts.cfg, params, mixed, 1.0)
    assert np.isfinite(float(other)) and abs(float(other) - float(want)) > 1e-3


def test_align_batch_scores_exactly_the_answer(tok):
    parts = _tiny_parts(tok)
    c = _recipe(parts)
    prompts = vlm_model.Prompts(parts.cfg, tok)
    b = vlm_stages.align_batch(c, parts.data, prompts, step=3, batch_size=2)
    assert prompts.n_visual == 36 and (b["tokens"] == vlm_model.IMAGE_TOKEN_ID).sum(axis=1).tolist() == [36, 36]
    for row in range(2):
        n = int(b["weight"][row].sum())
        where, target = b["where"][row, :n], b["target"][row, :n]
        np.testing.assert_array_equal(b["tokens"][row, where + 1], target)  # position p predicts token p + 1
        assert target[-1] == 2 and b["valid"][row].sum() == where[-1] + 2  # <|im_end|> closes the row
    again = vlm_stages.align_batch(c, parts.data, prompts, step=3, batch_size=2)
    assert all(np.array_equal(b[k], again[k]) for k in b)  # a batch is a function of the step alone


def test_video_batch_scores_the_clip_answers_and_feeds_the_frames(tok):
    parts = _tiny_parts(tok)
    parts = dataclasses.replace(parts, cfg=dataclasses.replace(parts.cfg, video_token_id=vlm_model.VIDEO_TOKEN_ID))
    c = dataclasses.replace(_recipe(parts), video=StageConfig(steps=2, batch_size=4, lr=1e-3))
    prompts = vlm_model.Prompts(parts.cfg, tok)
    b = vlm_stages.video_batch(c, parts.data, prompts, step=1, batch_size=4)
    assert b["frames"].shape == (2, 24, 3, 28, 28) and b["tiles"].shape == (4, 3, 28, 28)
    assert (b["tokens"] == vlm_model.IMAGE_TOKEN_ID).sum(axis=1).tolist() == [36, 36, 0, 0]
    assert (b["tokens"] == vlm_model.VIDEO_TOKEN_ID).sum(axis=1).tolist() == [0, 0, 97, 97]  # 24 x 2x2 + newline
    for row in (2, 3):
        n = int(b["weight"][row].sum())
        answer = tok.decode(b["target"][row, : n - 1])
        assert len(vlm_data.classes_named(answer)) == 3, answer
    params = vlm_stages.init_params(parts.cfg, 0)
    loss = jax.jit(lambda p, b: vlm_stages.align_loss(parts.cfg, p, parts.lm_serving, b)[0])
    base = float(loss(params, b))
    assert np.isfinite(base)
    assert float(loss(params, {**b, "frames": b["frames"][::-1]})) != base  # the clips reach their rows


@pytest.mark.integration
def test_stages_resume_bit_for_bit(tok, tmp_path):
    parts = _tiny_parts(tok)
    c = _recipe(parts)
    prompts = vlm_model.Prompts(parts.cfg, tok)
    cfg = parts.cfg
    p0 = vlm_stages.init_params(cfg, 0)

    def align(workdir, stop_at=None):
        return loop.stage(
            "align", c.align, p0, lambda p, lm, b: vlm_stages.align_loss(cfg, p, lm, b),
            lambda s: vlm_stages.align_batch(c, parts.data, prompts, s, c.align.batch_size), str(workdir),
            frozen=parts.lm_serving, stop_at=stop_at, progress=False).params

    straight = align(tmp_path / "a")
    align(tmp_path / "b", stop_at=2)
    resumed = align(tmp_path / "b")
    jax.tree.map(np.testing.assert_array_equal, straight, resumed)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), p0, straight))
    assert max(moved) > 0  # it trained


def test_adapter_refuses_another_language_model(tok, tmp_path):
    parts = _tiny_parts(tok)
    path = vlm_stages.export(_recipe(parts), parts, vlm_stages.init_params(parts.cfg, 0), str(tmp_path / "vlm"))
    meta = checkpoint.read_metadata(path)
    assert meta["config"]["language_model"] == "default" and not any(k.startswith("lm") for k in meta["params"])
    from sage_jax.io import loader

    with pytest.raises(checkpoint.CheckpointError, match="another language model"):
        loader.load(path)


def test_shipped_vlm_was_trained_by_the_readme_recipe():
    import dataclasses
    import json

    from configs.sage import smollm2_vlm
    from sage_jax.io import loader
    from sage_jax.training.vlm_recipe import VLMRecipe

    meta = checkpoint.read_metadata(loader.default_vlm())  # its sha256 manifest checked too
    recipe = VLMRecipe.from_config(smollm2_vlm.get_config())
    shipped, want = meta["provenance"]["recipe"], json.loads(json.dumps(recipe.to_json()))
    # Fields added to the recipe after the asset was trained must sit at their defaults (which keep the old
    # behaviour); every other field is the one the asset was trained with.
    defaults = {f.name: f.default for f in dataclasses.fields(VLMRecipe) if f.default is not dataclasses.MISSING}
    newer = want.keys() - shipped.keys()
    assert all(want[k] == defaults[k] for k in newer), {k: want[k] for k in newer}
    # The video stage ran on the VLM the recipe's tower and align stages had made (`init`, by its sha256).
    assert meta["provenance"]["init_sha256"] == IMAGE_STAGES_SHA256
    assert shipped == {k: v for k, v in want.items() if k not in newer} | {"init": shipped["init"]}
