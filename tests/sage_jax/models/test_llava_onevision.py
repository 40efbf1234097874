"""LLaVA-OneVision vs transformers' PyTorch model on tiny random checkpoints: fp32 logits and 32 greedy tokens for
one image, two anyres images (different grids, unpadding crop, the anyres_max downscale), a video with an image, a
left-padded batch, and a multi-image sample with strategy "default" and two feature layers; checkpoints sharded
into many files; every stored naming of the weights; one-line errors."""

import functools
import json
import time
import types

import numpy as np
import pytest
from flax import nnx

from sage_jax.io import hf
from sage_jax.io import hf_llava_onevision as hlo
from sage_jax.models import anyres
from sage_jax.models.llava_onevision import (
    PINPOINTS_384,
    LlavaOnevision,
    LlavaOnevisionConfig,
    expand_placeholders,
    video_inputs,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

IMAGE, VIDEO, PAD, EOS = 500, 501, 0, 2
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]


def _hf_config(**kw):
    base = dict(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=EOS, pad_token_id=PAD,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        image_token_index=IMAGE, video_token_index=VIDEO, vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_2", tie_word_embeddings=False)
    return transformers.LlavaOnevisionConfig(**{**base, **kw})


def _build(tmp_path_factory, name, **kw):
    """(reference, ours, config, directory): a perturbed random reference saved in 16 KB shards, read back."""
    torch.manual_seed(0)
    ref = transformers.LlavaOnevisionForConditionalGeneration(_hf_config(**kw)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor count
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    ref.save_pretrained(path, max_shard_size="16KB")
    with open(path / "config.json") as f:
        cfg = LlavaOnevisionConfig.from_hf(json.load(f))
    index = hf.tensor_index(path)
    params = hlo.read_params(cfg, index, hf.tensor_reader(index))
    model = LlavaOnevision(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return ref, model, cfg, path


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _build(tmp_path_factory, "llava_full")


@pytest.fixture(scope="module")
def processor():
    return transformers.LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                        image_grid_pinpoints=PINPOINTS, do_pad=True)


def _image(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _text(n, seed):
    return list(np.random.default_rng(seed).integers(10, 400, n))


def _left_pad(rows):
    t = max(len(r) for r in rows)
    ids = np.array([[PAD] * (t - len(r)) + r for r in rows], np.int64)
    mask = np.array([[0] * (t - len(r)) + [1] * len(r) for r in rows], np.int64)
    return ids, mask


def _check(ref, model, rel_err, inputs, label):
    """Logits (on kept positions) and 32 greedy tokens against transformers, on the same keyword arrays."""
    mask = inputs.get("attention_mask", np.ones_like(inputs["input_ids"]))
    t_in = {k: torch.tensor(np.asarray(v)) for k, v in inputs.items()}
    pos = np.cumsum(mask, axis=1) - 1
    with torch.no_grad():
        want = ref(**t_in, position_ids=torch.tensor(np.where(mask == 0, 1, pos))).logits.numpy()
        t0 = time.perf_counter()
        want_tokens = ref.generate(**t_in, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        t_ref = time.perf_counter() - t0
    want_tokens = want_tokens[:, inputs["input_ids"].shape[1]:].numpy()
    got = np.asarray(model(**inputs))
    keep = mask.astype(bool)
    err = rel_err(got[keep], want[keep])
    t0 = time.perf_counter()
    tokens = model.generate(**inputs, max_new_tokens=32)
    t_gen = time.perf_counter() - t0
    print(f"{label}: T={inputs['input_ids'].shape}, logits rel err {err:.2e}; generate 32 tokens {t_gen:.2f} s "
          f"(first call, compile included) vs transformers {t_ref:.2f} s")
    assert err <= 1e-4
    np.testing.assert_array_equal(tokens, want_tokens)


def test_one_image(full, processor, rel_err):
    ref, model, cfg, _ = full
    im = processor(images=[_image(90, 64, 1)], return_tensors="np")  # 2x2 grid, unpadding crops 2 columns
    lay = anyres.image_layout(im["image_sizes"][0], PINPOINTS, 28, 2, cfg.vision_aspect_ratio)
    assert lay.crop == (0, 4, 1, 3) and not lay.resized
    ids = np.array(expand_placeholders(cfg, [_text(5, 0) + [IMAGE] + _text(4, 1)], image_sizes=im["image_sizes"]))
    assert (ids == IMAGE).sum() == lay.num_features(cfg.base_tokens) == 4 + 4 * 3
    _check(ref, model, rel_err, dict(input_ids=ids, pixel_values=im["pixel_values"], image_sizes=im["image_sizes"]),
           "one image")


def test_two_anyres_images(full, processor, rel_err):
    ref, model, cfg, _ = full
    im = processor(images=[_image(100, 30, 2), _image(33, 70, 3)], return_tensors="np")
    tall, wide = (anyres.image_layout(s, PINPOINTS, 28, 2, cfg.vision_aspect_ratio) for s in im["image_sizes"])
    assert (tall.rows, tall.cols, tall.out_hw, tall.resized) == (3, 1, (4, 1), True)  # 6x2 map shrunk (ratio 1.22)
    assert (wide.rows, wide.cols, wide.crop, wide.resized) == (1, 3, (0, 2, 1, 5), False)
    prompt = _text(3, 4) + [IMAGE] + _text(2, 5) + [IMAGE] + _text(3, 6)
    ids = np.array(expand_placeholders(cfg, [prompt], image_sizes=im["image_sizes"]))
    inputs = dict(input_ids=ids, pixel_values=im["pixel_values"], image_sizes=im["image_sizes"])
    _check(ref, model, rel_err, inputs, "two anyres images")

    # A prompt with fewer <image> placeholders than images fails in one line, before anything runs.
    short = np.array(expand_placeholders(cfg, [_text(3, 4) + [IMAGE]], image_sizes=im["image_sizes"][:1]))
    with pytest.raises(ValueError, match=r"^the prompt has 12 <image> tokens but the 2 images give 26 features$"):
        model(input_ids=short, pixel_values=im["pixel_values"], image_sizes=im["image_sizes"])
    with pytest.raises(ValueError, match="unexpected keyword argument"):
        model(**inputs, pixel_mask=np.ones(3))
    with pytest.raises(ValueError, match="pixel_values has 2 images, image_sizes 1"):
        model(input_ids=ids, pixel_values=im["pixel_values"], image_sizes=im["image_sizes"][:1])


def test_video_with_image(full, processor, rel_err):
    ref, model, cfg, _ = full
    frames = np.random.default_rng(7).integers(0, 256, (3, 40, 50, 3), dtype=np.uint8)
    videos = video_inputs(frames, processor)
    assert videos.shape == (1, 3, 3, 28, 28)
    base = processor(images=[Image.fromarray(frames[1])], return_tensors="np")["pixel_values"][0, 0]
    np.testing.assert_allclose(videos[0, 1], base, rtol=0, atol=1e-6)  # the image processor's base-tile path

    im = processor(images=[_image(20, 20, 8)], return_tensors="np")
    prompt = _text(2, 9) + [VIDEO] + _text(3, 10) + [IMAGE] + _text(2, 11)
    ids = np.array(expand_placeholders(cfg, [prompt], image_sizes=im["image_sizes"], video_frames=3))
    assert (ids == VIDEO).sum() == 3 * 1 + 1
    inputs = dict(input_ids=ids, pixel_values=im["pixel_values"], image_sizes=im["image_sizes"],
                  pixel_values_videos=videos)
    _check(ref, model, rel_err, inputs, "video + image")

    emb, pos = model.embed(**inputs)
    text = (ids[0] != VIDEO) & (ids[0] != IMAGE)
    table = np.asarray(model.lm.embed[...])
    np.testing.assert_array_equal(np.asarray(emb)[0, text], table[ids[0, text]])
    np.testing.assert_array_equal(np.asarray(pos)[0], np.arange(ids.shape[1]))


def test_left_padded_batch(full, processor, rel_err):
    ref, model, cfg, _ = full
    im = processor(images=[_image(40, 50, 12), _image(20, 20, 13)], return_tensors="np")  # 4x4 map -> 2x2; 1x1 grid
    rows = expand_placeholders(cfg, [_text(2, 14) + [IMAGE] + _text(1, 15), _text(9, 16) + [IMAGE] + _text(6, 17)],
                               image_sizes=im["image_sizes"])
    ids, mask = _left_pad(rows)
    assert mask[0, 0] == 0 and mask[1].all()
    _check(ref, model, rel_err, dict(input_ids=ids, attention_mask=mask, pixel_values=im["pixel_values"],
                                     image_sizes=im["image_sizes"]), "left-padded batch of 2")


def test_multi_image_default_strategy_two_layers(tmp_path_factory, rel_err):
    """Images of a multi-image sample are not tiled (base tile + newline), "default" drops each tile's first token,
    two feature layers (the embeddings and layer 1) are concatenated before the projector, and 30-pixel tiles leave
    their last 2 pixels outside the 14-pixel patches (as so400m's 384-pixel tiles do)."""
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=30, patch_size=14)
    ref, model, cfg, _ = _build(tmp_path_factory, "llava_default", vision_feature_select_strategy="default",
                                vision_feature_layer=[0, -2], vision_config=vision,
                                image_grid_pinpoints=[[30, 30], [30, 60]])
    assert cfg.base_tokens == 3 and cfg.feature_layers == (0, -2) and cfg.vision.grid == 2
    processor = transformers.LlavaOnevisionImageProcessorPil(size={"height": 30, "width": 30},
                                                             image_grid_pinpoints=[[30, 30], [30, 60]], do_pad=True)
    im = processor(images=[[_image(40, 50, 18), _image(30, 100, 19)]], return_tensors="np")
    assert list(im["batch_num_images"]) == [2] and im["pixel_values"].shape[1] == 1
    prompt = _text(3, 20) + [IMAGE] + _text(2, 21) + [IMAGE] + _text(2, 22)
    ids = np.array(expand_placeholders(cfg, [prompt], image_sizes=im["image_sizes"], batch_num_images=[2]))
    assert (ids == IMAGE).sum() == 2 * (3 + 1)
    _check(ref, model, rel_err, dict(input_ids=ids, pixel_values=im["pixel_values"], image_sizes=im["image_sizes"],
                                     batch_num_images=im["batch_num_images"]), "multi-image, default, 2 layers")


def test_every_weight_naming_reads_the_same(full):
    """Sharded on-disk names, v5 in-memory names, and hub names with SigLIP's `vision_model.` prefix."""
    ref, _, cfg, path = full
    index = hf.tensor_index(path)
    assert len(set(index.values())) > 10  # really sharded
    from_disk = hf.flatten(hlo.read_params(cfg, index, hf.tensor_reader(index)))
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in sd) and "lm_head.weight" in sd
    hub = {k.replace("model.vision_tower.", "vision_tower.vision_model."): v for k, v in sd.items()}
    for names in (sd, hub):
        got = hf.flatten(hlo.read_params(cfg, names, names.__getitem__))
        assert got.keys() == from_disk.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], from_disk[k])


def test_config():
    with pytest.raises(ValueError, match="^expected a llava_onevision config, got model_type 'qwen2_5_vl'$"):
        LlavaOnevisionConfig.from_hf({"model_type": "qwen2_5_vl"})
    assert not hlo.is_llava_onevision({"model_type": "qwen2"}) and hlo.is_llava_onevision(_hf_config().to_dict())
    cfg = LlavaOnevisionConfig.from_hf(_hf_config().to_dict())
    assert LlavaOnevisionConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    big = LlavaOnevisionConfig.llava_ov_7b()
    assert (big.text.d_model, big.text.vocab_size, big.vision.num_layers, len(big.image_grid_pinpoints)) == (
        3584, 152128, 26, 36)
    assert LlavaOnevisionConfig.llava_ov_72b().text.n_layers == 80
    # Feature counts at the hub scale (27x27 patches per 384-pixel tile) agree with the processor's own formula.
    proc = transformers.LlavaOnevisionProcessor
    ns = types.SimpleNamespace(image_processor=types.SimpleNamespace(image_grid_pinpoints=PINPOINTS_384),
                               num_image_tokens=729, vision_aspect_ratio="anyres_max_9")
    ns._get_unpadded_features = functools.partial(proc._get_unpadded_features, ns)
    for size in [(480, 640), (640, 480), (1080, 1920), (300, 3000), (2000, 2100), (100, 120), (5000, 900)]:
        lay = anyres.image_layout(size, big.image_grid_pinpoints, 384, 27, "anyres_max_9")
        assert lay.num_features(729) == proc._get_number_of_features(ns, *size, 384, 384), size


def test_bilinear_matrix_matches_torch():
    x = torch.randn(1, 3, 7, 5)
    for size in [(4, 3), (3, 2), (5, 5), (1, 1), (9, 6)]:
        want = torch.nn.functional.interpolate(x, size=list(size), mode="bilinear").numpy()[0]
        got = np.einsum("oy,px,cyx->cop", anyres.bilinear_matrix(7, size[0]), anyres.bilinear_matrix(5, size[1]),
                        x.numpy()[0])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
