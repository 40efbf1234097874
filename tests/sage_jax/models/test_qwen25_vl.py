"""Qwen2.5-VL vs transformers' PyTorch `Qwen2_5_VLForConditionalGeneration` on a tiny random model (every
parameter perturbed, fp32) read from a sharded `save_pretrained` directory: logits and 32 greedy tokens for one
image, two images of odd aspect ratios plus a video, and a left-padded batch; M-RoPE indices; video
patchification; input errors."""

import json

import numpy as np
import pytest
from flax import nnx

from sage_jax.io import hf, hf_qwen25_vl
from sage_jax.models import layers, qwen25_vision
from sage_jax.models.config import LMConfig, RopeConfig
from sage_jax.models.qwen25_inputs import expand_placeholders, pad_batch, video_inputs
from sage_jax.models.qwen25_vl import Qwen25VL, Qwen25VLConfig, rope_index

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IMG, VID, VS, VE = 3, 4, 5, 6  # Qwen25VLConfig.tiny's special ids
N_NEW = 32


def _hf_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[2], tokens_per_second=2),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, our model) with the same weights, ours read from a many-file checkpoint."""
    torch.manual_seed(0)
    ref = transformers.Qwen2_5_VLForConditionalGeneration(_hf_config()).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor count
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.generation_config.eos_token_id = None  # greedy to the end, as ours
    path = tmp_path_factory.mktemp("qwen25_vl")
    ref.save_pretrained(path, max_shard_size="20KB")
    index = hf.tensor_index(path)
    assert len(set(index.values())) > 10  # sharded into many files
    cfg = Qwen25VLConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert cfg == Qwen25VLConfig.tiny().replace(text=cfg.text.replace(eos_token_ids=(2,)))
    params = hf_qwen25_vl.read_params(cfg, list(index), hf.tensor_reader(index))
    ours = Qwen25VL(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(ours, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(ours, state)
    # The inverse mapping gives back every stored tensor.
    back = hf_qwen25_vl.from_params(cfg, ours.params())
    read = hf.tensor_reader(index)
    assert set(back) == set(index)
    for name in back:
        np.testing.assert_array_equal(back[name], read(name))
    return ref, ours


@pytest.fixture(scope="module")
def processor():
    return transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                              temporal_patch_size=2)


def _image(h, w, seed):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _text(n, seed):
    return np.random.default_rng(seed).integers(7, 256, n).tolist()


def _video(seed, n_frames=4, h=70, w=100):
    frames = np.random.default_rng(seed).integers(0, 256, (n_frames, h, w, 3), dtype=np.uint8)
    return video_inputs(frames, fps=1.5, min_pixels=56 * 56, max_pixels=112 * 112)


def _check(ref, ours, rel_err, inputs, mask=None):
    """Logits on kept positions and 32 greedy tokens, ours against transformers."""
    mm = (inputs["input_ids"] == IMG).astype(np.int64) + 2 * (inputs["input_ids"] == VID)
    tin = {k: torch.as_tensor(np.asarray(v)) for k, v in inputs.items()}
    tin["mm_token_type_ids"] = torch.as_tensor(mm)
    with torch.no_grad():
        want = ref(**tin).logits.numpy()
        want_tokens = ref.generate(**tin, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    want_tokens = want_tokens[:, inputs["input_ids"].shape[1]:].numpy()
    got = np.asarray(ours(**inputs))
    keep = np.ones(got.shape[:2], bool) if mask is None else mask.astype(bool)
    err = rel_err(got[keep], want[keep])
    tokens = ours.generate(**inputs, max_new_tokens=N_NEW)
    return err, tokens, want_tokens


def test_one_image(models, processor, rel_err):
    ref, ours = models
    im = processor(images=[_image(90, 120, 0)], return_tensors="np")
    assert im["image_grid_thw"].tolist() == [[1, 6, 8]]  # 3x4 merged tokens: four (partial) 2x2 windows
    ids = expand_placeholders(_text(5, 1) + [VS, IMG, VE] + _text(6, 2), im["image_grid_thw"], image_token=IMG,
                              video_token=VID)
    inputs = dict(input_ids=np.array([ids]), attention_mask=np.ones((1, len(ids)), np.int64),
                  pixel_values=im["pixel_values"], image_grid_thw=im["image_grid_thw"])
    lay = qwen25_vision.layout(ours.cfg.vision, im["image_grid_thw"])
    assert len(set(lay["window_seg"].tolist())) == 4 and len(set(lay["frame_seg"].tolist())) == 1
    err, tokens, want = _check(ref, ours, rel_err, inputs)
    print(f"one image: logits rel err {err:.2e}")
    assert err <= 1e-4
    np.testing.assert_array_equal(tokens, want)
    # The prefill inputs the speculative engine takes.
    emb, pos, deltas = ours.embed(**inputs)
    want_pos, want_deltas = rope_index(ours.cfg, inputs["input_ids"], None, im["image_grid_thw"])
    assert emb.shape == (1, len(ids), 64)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(deltas, want_deltas)
    assert int(deltas[0]) == int(want_pos.max()) + 1 - len(ids) < 0


def test_two_images_and_a_video(models, processor, rel_err):
    ref, ours = models
    im = processor(images=[_image(60, 90, 3), _image(100, 50, 4)], return_tensors="np")
    assert im["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    vid = _video(5)
    ids = expand_placeholders(_text(3, 6) + [VS, IMG, VE] + _text(2, 7) + [VS, VID, VE] + _text(2, 8)
                              + [VS, IMG, VE] + _text(4, 9), im["image_grid_thw"], vid["video_grid_thw"],
                              image_token=IMG, video_token=VID)
    inputs = dict(input_ids=np.array([ids]), pixel_values=im["pixel_values"], image_grid_thw=im["image_grid_thw"],
                  **vid)
    err, tokens, want = _check(ref, ours, rel_err, inputs)
    print(f"two images + a video: logits rel err {err:.2e}")
    assert err <= 1e-4
    np.testing.assert_array_equal(tokens, want)


def test_left_padded_batch(models, processor, rel_err):
    ref, ours = models
    im = processor(images=[_image(84, 84, 10), _image(56, 112, 11), _image(112, 56, 12)], return_tensors="np")
    g = im["image_grid_thw"]
    row0 = expand_placeholders(_text(4, 13) + [VS, IMG, VE] + _text(3, 14), g[:1], image_token=IMG, video_token=VID)
    row1 = expand_placeholders([VS, IMG, VE] + _text(2, 15) + [VS, IMG, VE] + _text(2, 16), g[1:], image_token=IMG,
                               video_token=VID)
    ids, mask = pad_batch([row0, row1], pad_id=0, side="left")
    assert mask.min() == 0
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=im["pixel_values"], image_grid_thw=g)
    err, tokens, want = _check(ref, ours, rel_err, inputs, mask)
    print(f"left-padded batch: logits rel err {err:.2e}")
    assert err <= 1e-4
    np.testing.assert_array_equal(tokens, want)


def test_rope_index_matches_reference(models):
    ref, ours = models
    grids_img = np.array([[1, 4, 6], [1, 8, 4], [1, 2, 2]])
    grids_vid = np.array([[3, 4, 4], [2, 2, 6]])
    seconds = np.array([0.75, 1.3], np.float32)
    row0 = expand_placeholders(_text(3, 20) + [VS, IMG, VE, VS, VID, VE] + _text(2, 21), grids_img[:1],
                               grids_vid[:1], image_token=IMG, video_token=VID)
    row1 = expand_placeholders([VS, IMG, VE, VS, IMG, VE] + _text(1, 22) + [VS, VID, VE], grids_img[1:],
                               grids_vid[1:], image_token=IMG, video_token=VID)
    for side in ("left", "right"):
        ids, mask = pad_batch([row0, row1], pad_id=0, side=side)
        pos, deltas = rope_index(ours.cfg, ids, mask, grids_img, grids_vid, seconds)
        mm = (ids == IMG).astype(np.int64) + 2 * (ids == VID)
        want, want_deltas = ref.model.get_rope_index(
            torch.as_tensor(ids), torch.as_tensor(mm), image_grid_thw=torch.as_tensor(grids_img),
            video_grid_thw=torch.as_tensor(grids_vid), second_per_grid_ts=torch.as_tensor(seconds),
            attention_mask=torch.as_tensor(mask))
        keep = mask.astype(bool)
        np.testing.assert_array_equal(pos[keep], want.numpy().transpose(1, 2, 0)[keep])
        np.testing.assert_array_equal(deltas, want_deltas.numpy()[:, 0])


def test_video_patchification_matches_image_processor(processor):
    frame = np.random.default_rng(30).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    # Two identical frames are one temporal patch: the image processor's layout of the one frame.
    vid = video_inputs(np.stack([frame, frame]), processor)
    im = processor(images=[frame], return_tensors="np")
    np.testing.assert_array_equal(vid["video_grid_thw"], im["image_grid_thw"])
    np.testing.assert_allclose(vid["pixel_values_videos"], im["pixel_values"], rtol=0, atol=1e-6)
    # An odd frame count repeats the last frame; each row holds (C, Tp, p, p) with Tp the two frames of a pair.
    frames = np.random.default_rng(31).integers(0, 256, (3, 70, 100, 3), dtype=np.uint8)
    vid = video_inputs(frames, processor)
    assert vid["video_grid_thw"].tolist() == [[2, 4, 8]]  # 70x100 -> 56x112
    per_frame = [processor(images=[f], return_tensors="np")["pixel_values"].reshape(32, 3, 2, 196)[:, :, 0]
                 for f in frames]
    rows = vid["pixel_values_videos"].reshape(2, 32, 3, 2, 196)
    for t, (a, b) in enumerate([(0, 1), (2, 2)]):
        np.testing.assert_allclose(rows[t, :, :, 0], per_frame[a], atol=1e-6)
        np.testing.assert_allclose(rows[t, :, :, 1], per_frame[b], atol=1e-6)


def test_placeholder_mismatch_and_bad_inputs(models, processor):
    _, ours = models
    im = processor(images=[_image(56, 56, 40), _image(56, 56, 41)], return_tensors="np")
    ids = np.array([[7, VS, IMG, VE, 8]])  # one unexpanded placeholder, two images
    with pytest.raises(ValueError, match=r"1 image placeholder run\(s\) of 1 token\(s\).*2 image\(s\)"):
        ours(ids, pixel_values=im["pixel_values"], image_grid_thw=im["image_grid_thw"])
    with pytest.raises(ValueError, match="rows but image_grid_thw"):
        ours(ids, pixel_values=im["pixel_values"][:-1], image_grid_thw=im["image_grid_thw"])
    with pytest.raises(ValueError, match="unexpected keyword"):
        ours(ids, pixel_values=im["pixel_values"], image_grid_thw=im["image_grid_thw"], image_sizes=[1])
    with pytest.raises(ValueError, match="given together"):
        ours(ids, pixel_values=im["pixel_values"])


def test_config_from_hf_and_json():
    with pytest.raises(ValueError, match="not a Qwen2.5-VL config: model_type 'qwen2'"):
        Qwen25VLConfig.from_hf({"model_type": "qwen2"})
    nested = _hf_config().to_dict()
    cfg = Qwen25VLConfig.from_hf(nested)
    assert cfg.text.rope.mrope_section == (2, 3, 3) and cfg.vision.fullatt_block_indexes == (2,)
    # The older flat layout (text fields at the top, rope_scaling of type "mrope"), as hub files of 7B hold it.
    flat = {**{k: v for k, v in nested.pop("text_config").items() if k != "rope_parameters"}, **nested,
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    assert Qwen25VLConfig.from_hf(flat) == cfg
    assert Qwen25VLConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    for preset in (Qwen25VLConfig.qwen25_vl_7b(), Qwen25VLConfig.qwen25_vl_72b()):
        assert Qwen25VLConfig.from_json(json.loads(json.dumps(preset.to_json()))) == preset
    lm = LMConfig.tiny(rope=RopeConfig(mrope_section=(1, 1, 2)))
    assert LMConfig.from_json(json.loads(json.dumps(lm.to_json()))) == lm
    assert hf_qwen25_vl.is_qwen25_vl(nested | {"model_type": "qwen2_5_vl"})


def test_mrope_with_equal_streams_is_plain_rope():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 100, (2, 5)).astype(np.int32)
    inv, _ = layers.rope_inv_freq(RopeConfig(theta=1e6), 16)
    plain = layers.apply_rope(x, pos, inv)
    multi = layers.apply_rope(x, np.repeat(pos[..., None], 3, -1), inv, 1.0, (2, 3, 3))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(multi))
