"""Stage 3 of the home-trained VLM: its draft, the shipped EAGLE-style text head fine-tuned on the VLM's own answers.

The text head was trained on SmolLM2's features of text; in an image prompt it reads visual features it never saw,
and the VLM's answers ("The image shows an ankle boot.") are phrases it never drafted. So the VLM answers
`draft_rows` training images and `draft_clips` training clips (its greedy answers: the tokens speculative decoding
must reproduce), one target forward gives every row's last hidden states, and the head is trained teacher-forced on
them, as at decoding time: pairs (f_{t-1}, x_t) with the visual features as the inputs x_t of the visual slots, hard
cross-entropy on the next token of the answer over the head's reduced vocabulary.

    WORKDIR/draft/ckpt/, WORKDIR/draft/losses.json     the head's training (resumable, `loop.stage`)
    WORKDIR/draft_head/                                the fine-tuned head (kind "eagle_head")
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from configs import cli
from sage_jax.models import eagle_head, serving_lm
from sage_jax.models import llava_onevision as lo
from sage_jax.training import loop, vlm_data, vlm_model
from sage_jax.training.vlm_recipe import VLMRecipe


def rollout(c: VLMRecipe, parts: vlm_model.Parts, params: dict, n: int, max_new: int = 24, batch: int = 32,
            progress: bool = False) -> dict[str, np.ndarray]:
    """`n` training images (the recipe's mix) with questions from the templates, answered greedily by the VLM:
    left-padded prompt + answer (+ <|im_end|>) rows, and the images' pixels. One compile (fixed width)."""
    rng = np.random.default_rng([c.seed, 4])
    picks = vlm_model.draw(c, parts.data, rng, n)
    questions = [vlm_data.question_answer(s, int(parts.data[s].labels[r]), rng)[0] for s, r in picks]
    images = np.stack([parts.data[s].pixels[r] for s, r in picks])
    return answer_rows(parts, params, images, questions, max_new, batch, progress=progress)


def clip_rollout(parts: vlm_model.Parts, params: dict, n: int, rng: np.random.Generator, max_new: int = 24,
                 batch: int = 16, progress: bool = False) -> dict[str, np.ndarray]:
    """`n` clips of training Fashion-MNIST items (`vlm_data.draw_clip`) with the video questions, drawn by `rng`,
    answered greedily by the VLM `params` (`answer_rows`)."""
    got = [vlm_data.draw_clip(parts.data["fashion"], rng) for _ in range(n)]
    questions = [str(rng.choice(vlm_data.VIDEO_QUESTIONS)) for _ in range(n)]
    return answer_rows(parts, params, np.stack([f for f, _ in got]), questions, max_new, batch, progress=progress)


def answer_rows(parts: vlm_model.Parts, params: dict, images: np.ndarray, questions: list[str], max_new: int = 24,
                batch: int = 32, progress: bool = False) -> dict[str, np.ndarray]:
    """The VLM's greedy answers to `questions` about `images` [N, 28, 28, 3] (or clips [N, F, 28, 28, 3]):
    left-padded prompt + answer (+ <|im_end|>) rows ("tokens", "valid"; "answer": slot t scores its prediction of
    token t + 1, an answer token) and the images ("images", or "clips"). One compile per width."""
    cfg, tok = parts.cfg, parts.tokenizer
    n = len(images)
    video = images.ndim == 5
    prompts = vlm_model.Prompts(cfg, tok)
    ids = [prompts.video_prompt(q, images.shape[1]) if video else prompts.prompt(q) for q in questions]
    width = max(len(x) for x in ids)
    pad = cfg.text.pad_token_id
    tokens = np.full((n, width), pad, np.int32)
    valid = np.zeros((n, width), bool)
    for i, x in enumerate(ids):
        tokens[i, width - len(x):], valid[i, width - len(x):] = x, True
    full = {**params, "lm": parts.lm_params}
    out = np.zeros((n, max_new), np.int32)
    from tqdm.auto import tqdm

    # The last batch is padded with copies of its first row: the same shapes, no compile.
    for i in tqdm(range(0, n, batch), desc="answers", unit="batch", disable=not progress, leave=False):
        rows = np.arange(i, min(i + batch, n))
        take = np.concatenate([rows, np.full(batch - len(rows), rows[0])])
        tok_b, val_b = tokens[take], valid[take]
        pos = np.maximum(np.cumsum(val_b, axis=1) - 1, 0).astype(np.int32)
        plan, tiles, frames, image_slots, video_slots = vlm_model.media_inputs(cfg, tok_b, images[take])
        gen = lo.generate_tokens(cfg, plan, max_new, full, tok_b, tiles, frames, image_slots, video_slots, val_b, pos)
        out[rows] = np.asarray(gen)[: len(rows)]
    eos = cfg.text.eos_token_ids[0]
    seq = np.full((n, width + max_new), pad, np.int32)
    seq_valid = np.zeros(seq.shape, bool)
    answer = np.zeros(seq.shape, bool)  # slot t scores its prediction of token t + 1, an answer token
    for i in range(n):
        a = list(out[i])
        a = a[: a.index(eos) + 1] if eos in a else a
        seq[i, :width], seq[i, width: width + len(a)] = tokens[i], a
        seq_valid[i, :width], seq_valid[i, width: width + len(a)] = valid[i], True
        answer[i, width - 1: width - 1 + len(a)] = True
    return {"tokens": seq, "valid": seq_valid, "answer": answer, ("clips" if video else "images"): images}


def features(parts: vlm_model.Parts, params: dict, rows: dict[str, np.ndarray], batch: int = 16
             ) -> dict[str, np.ndarray]:
    """`rows` (of images, or of clips) with the target's inputs (visual features spliced in) and last hidden states
    of every slot."""
    cfg, lm = parts.cfg, parts.lm_serving

    @jax.jit
    def forward(params, lm, tokens, valid, tiles, frames):
        t = tokens.shape[1]
        plan, tiles, frames, image_slots, video_slots = vlm_model.visual_inputs(cfg, tokens, tiles, frames)
        x = lo.embed_inputs(cfg, plan, {**params, "lm": {"embed": lm.embed}}, tokens, tiles, frames, image_slots,
                            video_slots)
        positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
        mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
        hidden, _ = lm.forward(None, positions, mask, embeddings=x)
        return x, hidden

    video = "clips" in rows
    media = rows["clips" if video else "images"]
    n = len(rows["tokens"])
    embs, hiddens = [], []
    for i in range(0, n, batch):
        take = np.arange(i, i + batch) % n  # a full last batch (one compile); the extra rows are dropped
        if video:
            m = media[take]
            frames = vlm_model.pixels(m.reshape(-1, *m.shape[2:]))[:, 0].reshape(len(take), m.shape[1], 3,
                                                                                  vlm_model.TILE, vlm_model.TILE)
            tiles = np.zeros((0, 3, vlm_model.TILE, vlm_model.TILE), np.float32)
        else:
            frames, tiles = None, vlm_model.pixels(media[take]).reshape(-1, 3, vlm_model.TILE, vlm_model.TILE)
        x, h = forward(params, lm, rows["tokens"][take], rows["valid"][take], tiles, frames)
        keep = min(batch, n - i)
        embs.append(np.asarray(x)[:keep])
        hiddens.append(np.asarray(h)[:keep])
    return {**{k: v for k, v in rows.items() if k not in ("images", "clips")}, "embeddings": np.concatenate(embs),
            "hidden": np.concatenate(hiddens)}


def left_padded(parts: vlm_model.Parts, sets: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`features` of image rows and clip rows in one set: each left-padded to the widest (padding is invalid, so
    positions and masks, read from "valid", do not see it)."""
    width = max(d["tokens"].shape[1] for d in sets)
    fill = {"tokens": parts.cfg.text.pad_token_id, "valid": False, "answer": False, "embeddings": 0.0, "hidden": 0.0}
    out = {}
    for k, v in fill.items():
        out[k] = np.concatenate([np.pad(d[k], [(0, 0), (width - d[k].shape[1], 0)] + [(0, 0)] * (d[k].ndim - 2),
                                        constant_values=v) for d in sets])
    return out


def head_loss(head_cfg, head: dict, fixed: dict, batch: dict):
    """Teacher-forced hard cross-entropy of the head on the answers' next tokens (those in its vocabulary)."""
    tokens, valid = batch["tokens"], batch["valid"]
    t = tokens.shape[1]
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
    feats, _ = eagle_head.eagle_features(head, head_cfg, fixed["embed"], tokens,
                                         eagle_head.shift_features(batch["hidden"]), positions, mask,
                                         embeddings=batch["embeddings"])
    logits = serving_lm.head(head_cfg, None, fixed["final_norm"], fixed["vocab_head"], feats).astype(jnp.float32)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    idx = fixed["index"][nxt]  # the next token's column in the reduced vocabulary, -1 outside it
    w = (batch["answer"] & (idx >= 0)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, jnp.maximum(idx, 0)[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(logits, -1) == idx) * w
    return (ce * w).sum() / jnp.maximum(w.sum(), 1.0), {"acc": hit.sum() / jnp.maximum(w.sum(), 1.0)}


def train_head(c: VLMRecipe, parts: vlm_model.Parts, params: dict, head_path: str, workdir: str, *,
               progress: bool = True, log: Callable[[str], None] = loop.log_line, stop_at: int | None = None
               ) -> tuple[object, dict, np.ndarray, dict]:
    """Fine-tunes the head at `head_path` on the VLM's answers (module docstring); returns (head config, trained
    head params, vocabulary ids, the head checkpoint's metadata)."""
    from sage_jax.io import lm_checkpoint

    head_cfg, head, vocab_ids, meta = lm_checkpoint.load_head(head_path)
    if lm_checkpoint.head_taps(meta):
        raise ValueError(f"{head_path} fuses target layers {lm_checkpoint.head_taps(meta)}; the VLM draft stage takes "
                         f"a plain EAGLE-style head (the last hidden state)")
    if vocab_ids is None or "lm_head" in head:
        raise ValueError(f"{head_path}: the VLM draft stage takes a head over a reduced vocabulary of the target's "
                         f"LM-head rows")
    lm = parts.lm_serving
    index = np.full(parts.cfg.text.vocab_size, -1, np.int32)
    index[np.asarray(vocab_ids)] = np.arange(len(vocab_ids), dtype=np.int32)
    vocab_head = (lm.embed if lm.lm_head is None else lm.lm_head.T)[np.asarray(vocab_ids)].T
    fixed = {"embed": lm.embed, "final_norm": lm.final_norm, "vocab_head": vocab_head, "index": jnp.asarray(index)}
    data_file = os.path.join(workdir, "draft", "data.npz")
    if os.path.isfile(data_file):
        data = dict(np.load(data_file))
    else:
        clips = f" and {c.draft_clips} training clips" if c.draft_clips else ""
        log(f"draft: the VLM answers {c.draft_rows} training images{clips} (greedy), then one target forward over them")
        data = features(parts, params, rollout(c, parts, params, c.draft_rows))
        if c.draft_clips:
            if parts.cfg.video_token_id is None:
                raise ValueError("draft_clips: this VLM takes images only (no video token)")
            clip_rows = clip_rollout(parts, params, c.draft_clips, np.random.default_rng([c.seed, 6]))
            data = left_padded(parts, [data, features(parts, params, clip_rows)])
        with cli.written(data_file, "wb") as f:  # (cli.replacing makes its folder)
            np.savez(f, **data)
    sc = c.draft

    def batch_fn(step: int) -> dict:
        rows = np.random.default_rng([c.seed, 5, step]).integers(len(data["tokens"]), size=sc.batch_size)
        return {k: data[k][rows] for k in ("tokens", "valid", "answer", "embeddings", "hidden")}

    trained = loop.stage("draft", sc, head, lambda p, f, b: head_loss(head_cfg, p, f, b), batch_fn, workdir,
                         frozen=fixed, progress=progress, log=log, stop_at=stop_at)
    return head_cfg, trained.params, np.asarray(vocab_ids), meta
