"""The VLM's EAGLE-style head stage: its rows of images and of clips, and the loss that trains on them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import eagle_head
from sage_jax.training import vlm_data, vlm_head, vlm_model, vlm_stages

from .test_vlm_draft import tok  # noqa: F401  (the fixture)
from .test_vlm_stages import _tiny_parts


@pytest.mark.integration  # ~30 s of compiles on 2 cores
def test_clip_rows_join_image_rows_left_padded_and_the_padding_is_invisible(tok):  # noqa: F811
    """The draft stage's image rows and clip rows (`draft_clips`) share one left-padded width; the head's loss on an
    image row is the same padded or not (positions and masks come from "valid"), and the clip rows carry the
    frames' features into their 97 video slots."""
    parts = _tiny_parts(tok)
    parts = dataclasses.replace(parts, cfg=dataclasses.replace(parts.cfg, video_token_id=vlm_model.VIDEO_TOKEN_ID))
    own = vlm_stages.init_params(parts.cfg, 0)
    images = vlm_head.answer_rows(parts, own, parts.data["fashion"].pixels[:2], [vlm_data.DEFAULT_QUESTION] * 2,
                                  max_new=4, batch=2)
    clips = vlm_head.clip_rollout(parts, own, 2, np.random.default_rng(0), max_new=4, batch=2)
    f_img, f_clip = (vlm_head.features(parts, own, r, batch=2) for r in (images, clips))
    both = vlm_head.left_padded(parts, [f_img, f_clip])
    width = f_clip["tokens"].shape[1]
    assert f_img["tokens"].shape[1] < width and both["tokens"].shape == (4, width)
    assert both["hidden"].shape == (4, width, parts.cfg.text.d_model)
    assert (both["tokens"][2:] == vlm_model.VIDEO_TOKEN_ID).sum(axis=1).tolist() == [97, 97]
    np.testing.assert_array_equal(both["valid"][:2].sum(1), f_img["valid"].sum(1))
    # the video slots hold the clips' projected features, not the placeholder's embedding
    slots = both["tokens"][2] == vlm_model.VIDEO_TOKEN_ID
    placeholder = np.asarray(parts.lm_serving.embed)[vlm_model.VIDEO_TOKEN_ID]
    assert np.abs(both["embeddings"][2][slots] - placeholder).max() > 1e-3

    head_cfg = eagle_head.head_config(parts.cfg.text)
    head = eagle_head.init_params(head_cfg, 0)
    lm = parts.lm_serving
    v = parts.cfg.text.vocab_size
    fixed = {"embed": lm.embed, "final_norm": lm.final_norm, "vocab_head": lm.embed.T,
             "index": jnp.arange(v, dtype=jnp.int32)}
    keys = ("tokens", "valid", "answer", "embeddings", "hidden")
    alone = vlm_head.head_loss(head_cfg, head, fixed, {k: f_img[k] for k in keys})[0]
    padded = vlm_head.head_loss(head_cfg, head, fixed, {k: both[k][:2] for k in keys})[0]
    np.testing.assert_allclose(float(padded), float(alone), rtol=1e-5)
    assert np.isfinite(float(vlm_head.head_loss(head_cfg, head, fixed, {k: both[k] for k in keys})[0]))
