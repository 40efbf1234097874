"""Training the home-trained VLM (`python -m sage_jax.train_vlm`): tower stage, align stage, evaluation, export.

Work directory layout (rerunning resumes: a finished stage is skipped, a stage resumes from its Orbax checkpoint
bit for bit, because every batch is drawn from (seed, stage, step) alone; `loop.stage`)::

    WORKDIR/tower/ckpt/, WORKDIR/tower/losses.json     stage 1: the tower as a classifier
    WORKDIR/align/ckpt/, WORKDIR/align/losses.json     stage 2: tower + projector under the frozen LM
    WORKDIR/align/evals.json                           held-out accuracy of the greedy answers, per evaluation
    WORKDIR/video/ckpt/, WORKDIR/video/losses.json     the video stage (when the recipe has one): clips and images
    WORKDIR/video/evals.json                           held-out clip and image accuracy, per evaluation
    WORKDIR/vlm/                                       the exported model: kind "vlm", language model "default"
    WORKDIR/draft/ckpt/, WORKDIR/draft/data.npz         stage 3 (`vlm_head.py`): the head on the VLM's answers
    WORKDIR/vlm/draft/                                 the fine-tuned head (kind "eagle_head"), the VLM's draft
    WORKDIR/loss.png                                   both stages' losses
    WORKDIR/summary.json
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sage_jax.models import llava_onevision as lo
from sage_jax.models import serving_lm
from sage_jax.models.siglip import ACTIVATIONS, SiglipVision, hidden_states
from sage_jax.training import loop, vlm_data, vlm_model
from sage_jax.training.vlm_recipe import VLMRecipe

#: Offsets of each source's classes in the tower stage's probe.
_OFFSET = {"fashion": 0, "digits": 10, "photos": 20}
N_PROBE = 20 + len(vlm_data.PHOTOS)


def init_params(cfg: lo.LlavaOnevisionConfig, seed: int) -> dict:
    """Fresh tower, projector and image_newline (the VLM's parameters other than the language model's)."""
    rngs = nnx.Rngs(seed)
    vision = nnx.to_pure_dict(nnx.state(SiglipVision(cfg.vision, rngs=rngs), nnx.Param))
    proj = nnx.to_pure_dict(nnx.state(lo.Projector(cfg, rngs=rngs), nnx.Param))
    d = cfg.text.d_model
    newline = jax.random.normal(rngs.params(), (d,), jnp.float32) * d**-0.5
    return {"vision": vision, "projector": proj, "image_newline": newline}


# ----------------------------------------------------------------------------------------------------- batches


def _image(data, source: str, row: int, rng: np.random.Generator, shift: int = 0) -> np.ndarray:
    x = data[source].pixels[row]
    x = x[:, ::-1] if source != "digits" and rng.random() < 0.5 else x  # mirrored clothes / photos stay true
    if shift:
        dy, dx = rng.integers(-shift, shift + 1, size=2)  # the image moves down by dy, right by dx
        y0, x0 = shift - dy, shift - dx
        x = np.pad(x, ((shift, shift), (shift, shift), (0, 0)))[y0: y0 + vlm_data.SIZE, x0: x0 + vlm_data.SIZE]
    return x


def tower_batch(c: VLMRecipe, data, step: int, batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([c.seed, 1, step])
    picks = vlm_model.draw(c, data, rng, batch_size)
    images = np.stack([_image(data, s, r, rng, c.shift) for s, r in picks])
    labels = np.asarray([_OFFSET[s] + int(data[s].labels[r]) for s, r in picks], np.int32)
    out = {"pixels": vlm_model.pixels(images)[:, 0], "labels": labels}
    if c.cutmix:
        out["pixels"], out["token_labels"] = cutmix(out["pixels"], labels, c.cutmix, c.vision.patch_size,
                                                    np.random.default_rng([c.seed, 11, step]))
    return out


def cutmix(pixels: np.ndarray, labels: np.ndarray, share: float, patch: int,
           rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """CutMix on the patch grid: each of a `share` of the rows of `pixels` [M, C, S, S] takes a random box of whole
    `patch`-pixel patches (never the whole image) from a random row (a permutation's: now and then its own);
    returns the pixels and every patch's label [M, P] (row-major patches, the tower's token order)."""
    m, g = len(labels), pixels.shape[-1] // patch
    out = pixels.copy()
    tokens = np.repeat(labels[:, None], g * g, axis=1).reshape(m, g, g)
    partner = rng.permutation(m)
    for i in np.nonzero(rng.random(m) < share)[0]:
        h, w = rng.integers(1, g, size=2)
        y, x = rng.integers(0, g - h + 1), rng.integers(0, g - w + 1)
        box = (slice(y * patch, (y + h) * patch), slice(x * patch, (x + w) * patch))
        out[(i, slice(None), *box)] = pixels[(partner[i], slice(None), *box)]
        tokens[i, y: y + h, x: x + w] = labels[partner[i]]
    return out, tokens.reshape(m, g * g).astype(np.int32)


def _rows(pad: int, rows: list[tuple[list[int], list[int]]], t: int, a: int) -> dict[str, np.ndarray]:
    """Right-padded rows [prompt with visual tokens ; answer ; <|im_end|>], the answer's positions and targets."""
    n = len(rows)
    tokens = np.full((n, t), pad, np.int32)
    valid = np.zeros((n, t), bool)
    where = np.zeros((n, a), np.int32)
    target = np.zeros((n, a), np.int32)
    weight = np.zeros((n, a), np.float32)
    for i, (p, y) in enumerate(rows):
        if len(p) + len(y) > t or len(y) > a:
            raise ValueError(f"a row of {len(p)} + {len(y)} tokens does not fit seq_len {t} / answer_len {a}")
        tokens[i, : len(p) + len(y)] = p + y
        valid[i, : len(p) + len(y)] = True
        where[i, : len(y)] = np.arange(len(p) - 1, len(p) - 1 + len(y))
        target[i, : len(y)] = y
        weight[i, : len(y)] = 1.0
    return {"tokens": tokens, "valid": valid, "where": where, "target": target, "weight": weight}


def align_batch(c: VLMRecipe, data, prompts: vlm_model.Prompts, step: int, batch_size: int,
                seq_len: int | None = None, stage: int = 2) -> dict[str, np.ndarray]:
    """`batch_size` image rows (`_rows`) with their tiles."""
    rng = np.random.default_rng([c.seed, stage, step])
    picks = vlm_model.draw(c, data, rng, batch_size)
    rows, images = [], []
    for s, r in picks:
        q, ans = vlm_data.question_answer(s, int(data[s].labels[r]), rng)
        rows.append((prompts.prompt(q), prompts.answer(ans)))
        images.append(_image(data, s, r, rng))
    out = _rows(prompts.cfg.text.pad_token_id, rows, seq_len or c.seq_len, c.answer_len)
    return {**out, "tiles": vlm_model.pixels(np.stack(images)).reshape(-1, 3, vlm_model.TILE, vlm_model.TILE)}


def video_batch(c: VLMRecipe, data, prompts: vlm_model.Prompts, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """The video stage's batch: image rows (`align_batch`) then `video_share` of the rows clips of training
    Fashion-MNIST items (`vlm_data.draw_clip`) asked which items appear; "frames" [Nv, F, 3, 28, 28]."""
    n_vid = max(1, round(batch_size * c.video_share))
    n_img = batch_size - n_vid
    rng = np.random.default_rng([c.seed, 4, step])
    rows, clips = [], []
    for _ in range(n_vid):
        frames, labels = vlm_data.draw_clip(data["fashion"], rng)
        q = str(rng.choice(vlm_data.VIDEO_QUESTIONS))
        rows.append((prompts.video_prompt(q, len(frames)), prompts.answer(vlm_data.clip_answer(labels))))
        clips.append(vlm_model.pixels(frames)[:, 0])
    vid = _rows(prompts.cfg.text.pad_token_id, rows, c.video_seq_len, c.answer_len)
    if not n_img:
        return {**vid, "tiles": np.zeros((0, 3, vlm_model.TILE, vlm_model.TILE), np.float32),
                "frames": np.stack(clips)}
    img = align_batch(c, data, prompts, step, n_img, seq_len=c.video_seq_len, stage=5)
    out = {k: np.concatenate([img[k], vid[k]]) for k in vid}
    return {**out, "tiles": img["tiles"], "frames": np.stack(clips)}


# -------------------------------------------------------------------------------------------------------- losses


def tower_loss(cfg: lo.LlavaOnevisionConfig, params: dict, batch: dict, token_loss: float = 0.0):
    """The mean-pooled probe's cross-entropy, plus `token_loss` times the mean cross-entropy of every token's own
    probe logits (the same probe): the projector is a per-token map, so what reaches the LM is each token alone."""
    h = hidden_states(cfg.vision, params["vision"], batch["pixels"], (-1,))[0]  # [M, P, Dv]
    w, b = params["probe"]["w"], params["probe"]["b"]
    logits = h.mean(axis=1) @ w + b[None]
    if "token_labels" in batch:  # CutMix rows: the pooled target is the patches' labels mixed by area
        labels = batch["token_labels"]
        soft = jax.nn.one_hot(labels, logits.shape[-1]).mean(axis=1)
        ce = optax.softmax_cross_entropy(logits, soft).mean()
    else:
        labels = jnp.broadcast_to(batch["labels"][:, None], h.shape[:2])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    if token_loss:
        per = h @ w + b[None, None]  # [M, P, K]
        ce = ce + token_loss * optax.softmax_cross_entropy_with_integer_labels(per, labels).mean()
    return ce, {"acc": jnp.mean(jnp.argmax(logits, -1) == batch["labels"])}


def align_loss(cfg: lo.LlavaOnevisionConfig, params: dict, lm: serving_lm.LM, batch: dict):
    """Mean cross-entropy of the frozen LM on the answer tokens, given the image (and video) features of
    `params`: rows of images ("tiles", two a row), then rows of clips ("frames" [Nv, F, 3, S, S]) when given."""
    tokens, valid = batch["tokens"], batch["valid"]
    t = tokens.shape[1]
    plan, tiles, frames, image_slots, video_slots = vlm_model.visual_inputs(cfg, tokens, batch["tiles"],
                                                                            batch.get("frames"))
    x = lo.embed_inputs(cfg, plan, {**params, "lm": {"embed": lm.embed}}, tokens, tiles, frames, image_slots,
                        video_slots)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
    hidden, _ = lm.forward(None, positions, mask, embeddings=x)
    h = jnp.take_along_axis(hidden, batch["where"][..., None], axis=1)
    logits = lm.head(h).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["target"])
    w = batch["weight"]
    hit = (jnp.argmax(logits, -1) == batch["target"]) * w
    return (ce * w).sum() / w.sum(), {"acc": hit.sum() / w.sum()}


def probe_accuracy(cfg: lo.LlavaOnevisionConfig, tower: dict, n: int = 2000) -> dict:
    """The tower stage's probe on `n` Fashion-MNIST dev images: the mean-pooled prediction's accuracy and the mean
    accuracy of every visual token's own prediction."""
    test = vlm_data.fashion("dev")
    idx = vlm_data.heldout_indices(n, "dev")
    f = jax.jit(lambda v, x: hidden_states(cfg.vision, v, x, (-1,))[0])
    w, b = np.asarray(tower["probe"]["w"]), np.asarray(tower["probe"]["b"])
    pooled, token = [], []
    for i in range(0, n, 250):
        h = np.asarray(f(tower["vision"], vlm_model.pixels(test.pixels[idx[i: i + 250]])[:, 0]))
        y = test.labels[idx[i: i + 250]][:, None]
        pooled.append(np.argmax(h.mean(1) @ w + b, -1) == y[:, 0])
        token.append(np.argmax(h @ w + b, -1) == y)
    return {"pooled": float(np.concatenate(pooled).mean()), "token": float(np.concatenate(token).mean()), "n": n}


def _cached(path: str, compute: Callable[[], dict]) -> dict:
    """compute() once per work directory (a resumed run reads it back)."""
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        loop.write_json(path, compute())
    return loop.read_json(path, {})


def warm_projector(c: VLMRecipe, parts: vlm_model.Parts, params: dict, lam: float = 1e-3) -> dict:
    """`params` with projector w2 / b2 fitted by ridge regression (w1 kept at its initialisation) so that every
    visual token of an image lands on the LM's embedding of its class's short name (`vlm_data.SHORT_NAMES`), and
    image_newline set to the embedding of "\\n"."""
    cfg, tok = parts.cfg, parts.tokenizer
    embed = np.asarray(parts.lm_serving.embed, np.float64)

    def word(text: str) -> np.ndarray:
        return embed[tok(text, add_special_tokens=False)["input_ids"]].mean(axis=0)

    picks = vlm_model.draw(c, parts.data, np.random.default_rng([c.seed, 3]), c.ridge_images)
    images = np.stack([parts.data[s].pixels[r] for s, r in picks])
    y = np.stack([word(vlm_data.SHORT_NAMES[s][int(parts.data[s].labels[r])]) for s, r in picks])
    p = params["projector"]
    act = ACTIVATIONS[cfg.projector_act]
    first = jax.jit(lambda v, x: act(hidden_states(cfg.vision, v, x, (-1,))[0] @ p["w1"] + p["b1"][None, None]))
    h = np.concatenate([np.asarray(first(params["vision"], vlm_model.pixels(images[i: i + 256])[:, 0]), np.float64)
                        for i in range(0, len(images), 256)])  # [N, P, D]
    n, per, d = h.shape
    h = h.reshape(n * per, d)
    y = np.repeat(y, per, axis=0)
    hm, ym = h.mean(0), y.mean(0)
    hc = h - hm
    gram = hc.T @ hc
    w2 = np.linalg.solve(gram + lam * np.trace(gram) / d * np.eye(d), hc.T @ (y - ym))
    proj = {**p, "w2": jnp.asarray(w2, jnp.float32), "b2": jnp.asarray(ym - hm @ w2, jnp.float32)}
    return {**params, "projector": proj, "image_newline": jnp.asarray(word("\n"), jnp.float32)}


# ------------------------------------------------------------------------------------------------- evaluation


def answer(parts: vlm_model.Parts, params: dict, images: np.ndarray, question: str | None = None,
           max_new_tokens: int = 16, batch_size: int = 16) -> list[str]:
    """Greedy answers (plain decoding, the model's own `generate`) to `question` about each 28x28 image [N, 28, 28,
    3], or each clip [N, F, 28, 28, 3] (default question: `DEFAULT_QUESTION`, or `VIDEO_QUESTION` for clips)."""
    video = images.ndim == 5
    cfg = parts.cfg
    prompts = vlm_model.Prompts(cfg, parts.tokenizer)
    if video:
        ids = prompts.video_prompt(question or vlm_data.VIDEO_QUESTION, images.shape[1])
    else:
        ids = prompts.prompt(question or vlm_data.DEFAULT_QUESTION)
    ids = np.asarray([ids] * len(images), np.int32)
    full = {**params, "lm": parts.lm_params}
    out = []
    for i in range(0, len(images), batch_size):
        chunk = images[i: i + batch_size]
        n = len(chunk)
        tok = ids[:n]
        valid = np.ones(tok.shape, bool)
        pos = np.broadcast_to(np.arange(tok.shape[1], dtype=np.int32), tok.shape)
        plan, tiles, frames, image_slots, video_slots = vlm_model.media_inputs(cfg, tok, chunk)
        gen = lo.generate_tokens(cfg, plan, max_new_tokens, full, tok, tiles, frames, image_slots, video_slots, valid,
                                 pos)
        out += [parts.tokenizer.decode(_until_eos(row, cfg.text.eos_token_ids), skip_special_tokens=True)
                for row in np.asarray(gen)]
    return out


def heldout_video_accuracy(parts: vlm_model.Parts, params: dict, n: int, split: str = "test") -> dict:
    """Greedy answers to `n` held-out clips of `split` (`vlm_data.heldout_clips`): "accuracy", the share that name
    exactly the clip's items; "items", the share of the clips' items named."""
    clips, labels = vlm_data.heldout_clips(n, split=split)
    texts = answer(parts, params, clips, max_new_tokens=20, batch_size=8)
    named = [vlm_data.classes_named(t) for t in texts]
    right = [k == {int(x) for x in y} for k, y in zip(named, labels, strict=True)]
    items = [len(k & {int(x) for x in y}) / len(y) for k, y in zip(named, labels, strict=True)]
    return {"accuracy": float(np.mean(right)), "items": float(np.mean(items)), "n": n, "example": texts[0]}


def _until_eos(row, eos) -> list[int]:
    row = [int(x) for x in row]
    ends = [i for i, x in enumerate(row) if x in eos]
    return row[: ends[0]] if ends else row


def heldout_accuracy(parts: vlm_model.Parts, params: dict, n: int, split: str = "test") -> dict:
    """Greedy answers to `n` held-out Fashion-MNIST images of `split`: the share that name the right class."""
    test = vlm_data.fashion(split)
    idx = vlm_data.heldout_indices(n, split)
    texts = answer(parts, params, test.pixels[idx])
    named = [vlm_data.class_named(t) for t in texts]
    right = [int(k == int(y)) if k is not None else 0 for k, y in zip(named, test.labels[idx], strict=True)]
    return {"accuracy": float(np.mean(right)), "n": n, "example": texts[0]}


# ------------------------------------------------------------------------------------------------- the recipe


def run(c: VLMRecipe, workdir: str, *, progress: bool = True, log: Callable[[str], None] = loop.log_line,
        parts: vlm_model.Parts | None = None, heldout: int = 100) -> dict:
    """The stages (tower and align, or the VLM `c.init`; then video when set), the export to WORKDIR/vlm, the
    draft head, the loss plot and WORKDIR/summary.json (module docstring)."""
    t0 = time.perf_counter()
    parts = parts or vlm_model.load_parts(c)
    cfg = parts.cfg
    fresh = init_params(cfg, c.seed)
    log(f"tower: {_count(fresh['vision']):,} params; projector + newline: "
        f"{_count(fresh['projector']) + cfg.text.d_model:,}; {vlm_model.n_visual(cfg)} visual tokens per image")
    prompts = vlm_model.Prompts(cfg, parts.tokenizer)
    if c.init is not None:
        params, probe_acc = initial(c, cfg), None
        log(f"tower and align stages: the trained VLM {c.init}")
    else:
        params, probe_acc = _image_stages(c, parts, fresh, prompts, workdir, progress, log)
    if c.video is not None:
        labels = {k: jax.tree.map(lambda _, k=k: "tower" if k == "vision" else "proj", v) for k, v in params.items()}
        opt = loop.optimizer(c.video, labels, {"tower": c.tower_lr_scale, "proj": 1.0})

        def evaluate(p, s):
            return {**heldout_video_accuracy(parts, p, c.eval_images, "dev"),
                    "image": heldout_accuracy(parts, p, c.eval_images, "dev")["accuracy"]}

        params = loop.stage(
            "video", c.video, params, lambda p, lm, b: align_loss(cfg, p, lm, b),
            lambda s: video_batch(c, parts.data, prompts, s, c.video.batch_size), workdir, opt=opt,
            frozen=parts.lm_serving, evaluate=evaluate, progress=progress, log=log).params
    out = export(c, parts, params, os.path.join(workdir, "vlm"))
    if c.draft is not None:
        from configs import checkpoint

        out_head = export_draft(c, parts, params, workdir, progress=progress, log=log)
        checkpoint.write_sums(out)  # the VLM's manifest lists the head it ships inside
        log(f"draft head: {out_head}")
    final = heldout_accuracy(parts, params, heldout)
    log(f"held-out Fashion-MNIST test images: {final['accuracy']:.1%} of {heldout} answers name the right class")
    summary = {"heldout": final, "probe": probe_acc, "export": out}
    if c.video is not None:
        clips = heldout_video_accuracy(parts, params, heldout)
        log(f"held-out clips: {clips['accuracy']:.1%} of {heldout} answers name exactly the clip's items")
        summary["heldout_video"] = clips
    plot(workdir)
    summary.update(seconds=time.perf_counter() - t0, recipe=c.to_json())
    loop.write_json(os.path.join(workdir, "summary.json"), summary)
    return summary


def initial(c: VLMRecipe, cfg: lo.LlavaOnevisionConfig) -> dict:
    """The tower, projector and image_newline of the trained VLM `c.init` (checked against the recipe's tower)."""
    from configs import checkpoint
    from sage_jax.io import vlm_checkpoint

    if not os.path.isdir(c.init):
        raise FileNotFoundError(f"init: no VLM checkpoint at {c.init}")
    _, got = vlm_checkpoint.read_config(c.init)
    if getattr(got, "vision", None) != cfg.vision:
        raise ValueError(f"init: {c.init} is not a VLM with this recipe's tower ({cfg.vision})")
    own = checkpoint.restore(c.init)
    return {k: jax.tree.map(jnp.asarray, own[k]) for k in ("vision", "projector", "image_newline")}


def _image_stages(c: VLMRecipe, parts: vlm_model.Parts, fresh: dict, prompts: vlm_model.Prompts, workdir: str,
                  progress: bool, log: Callable[[str], None]) -> tuple[dict, dict]:
    """The tower and align stages: (params, the tower probe's held-out accuracy)."""
    cfg = parts.cfg
    dv = cfg.vision.hidden_size
    probe = {"w": jnp.zeros((dv, N_PROBE)), "b": jnp.zeros(N_PROBE)}
    tower = loop.stage(
        "tower", c.tower, {"vision": fresh["vision"], "probe": probe},
        lambda p, f, b: tower_loss(cfg, p, b, c.token_loss),
        lambda s: tower_batch(c, parts.data, s, c.tower.batch_size), workdir, progress=progress, log=log).params
    probe_acc = _cached(os.path.join(workdir, "tower", "probe.json"), lambda: probe_accuracy(cfg, tower))
    log(f"tower probe on held-out Fashion-MNIST: {probe_acc}")
    params = {"vision": tower["vision"], "projector": fresh["projector"], "image_newline": fresh["image_newline"]}
    if c.warm_start:
        params = warm_projector(c, parts, params)
        warm = _cached(os.path.join(workdir, "align", "warm_start.json"),
                       lambda: heldout_accuracy(parts, params, c.eval_images, "dev"))
        log(f"warm start alone (no align step): held-out {warm}")
    labels = {k: jax.tree.map(lambda _, k=k: "tower" if k == "vision" else "proj", v) for k, v in params.items()}
    opt = loop.optimizer(c.align, labels, {"tower": c.tower_lr_scale, "proj": 1.0})
    params = loop.stage(
        "align", c.align, params, lambda p, lm, b: align_loss(cfg, p, lm, b),
        lambda s: align_batch(c, parts.data, prompts, s, c.align.batch_size), workdir, opt=opt,
        frozen=parts.lm_serving, evaluate=lambda p, s: heldout_accuracy(parts, p, c.eval_images, "dev"),
        progress=progress, log=log).params
    return params, probe_acc


def _count(tree) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


def export(c: VLMRecipe, parts: vlm_model.Parts, params: dict, out: str) -> str:
    """The trained VLM as our checkpoint (kind "vlm", its language model the shipped default, not copied)."""
    import tempfile

    from configs import provenance
    from sage_jax.io import vlm_checkpoint

    record = {"recipe": c.to_json(), "trained_by": "python -m sage_jax.train_vlm"}
    if c.init is not None:
        record["init_sha256"] = provenance.checkpoint_sha256(c.init)
    with tempfile.TemporaryDirectory() as proc:
        vlm_model.write_processor(proc)
        return vlm_checkpoint.save_adapter(out, parts.cfg, params, parts.tokenizer, proc, overwrite=True,
                                           provenance=record)


def export_draft(c: VLMRecipe, parts: vlm_model.Parts, params: dict, workdir: str, *, progress: bool = True,
                 log: Callable[[str], None] = loop.log_line) -> str:
    """The draft stage (`vlm_head.py`) on the shipped head; writes WORKDIR/vlm/draft (shipped inside the VLM)."""
    from sage_jax.io import lm_checkpoint, loader
    from sage_jax.training import vlm_head

    head = loader.default_draft()
    if head is None:
        raise FileNotFoundError("the draft stage fine-tunes the shipped head, which this checkout lacks")
    head_cfg, trained, vocab_ids, meta = vlm_head.train_head(c, parts, params, head, workdir, progress=progress,
                                                              log=log)
    return lm_checkpoint.save_head(os.path.join(workdir, "vlm", "draft"), head_cfg, trained, target_cfg=parts.cfg.text,
                           vocab_ids=vocab_ids, dtype="bfloat16", overwrite=True,
                           provenance={"recipe": c.to_json(), "fine_tuned_from": "sage_jax/assets/smollm2_eagle",
                                       "trained_by": "python -m sage_jax.train_vlm"})


def plot(workdir: str) -> str:
    """WORKDIR/loss.png: each stage's training loss (and the held-out accuracy of the align stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [n for n in ("tower", "align", "video", "draft")
              if os.path.isfile(os.path.join(workdir, n, "losses.json"))]
    fig, axes = plt.subplots(1, max(1, len(stages)), figsize=(5 * max(1, len(stages)), 3.5), squeeze=False)
    for ax, name in zip(axes[0], stages, strict=True):
        losses = loop.read_json(os.path.join(workdir, name, "losses.json"), {})
        steps = sorted(int(k) for k in losses)
        ys = np.asarray([losses[str(s)] for s in steps])
        if len(ys):
            k = max(1, len(ys) // 50)
            smooth = np.convolve(ys, np.ones(k) / k, mode="valid")
            ax.plot(steps, ys, alpha=0.3, lw=0.8)
            ax.plot(steps[k - 1:], smooth, lw=1.5)
        ax.set(title=f"{name} stage", xlabel="step", ylabel="cross-entropy")
        evals = loop.read_json(os.path.join(workdir, name, "evals.json"), {})
        if evals:
            ax2 = ax.twinx()
            xs = sorted(int(k) for k in evals)
            ax2.plot(xs, [evals[str(x)]["accuracy"] for x in xs], "o-", color="C3")
            ax2.set(ylabel="held-out accuracy", ylim=(0, 1))
    fig.tight_layout()
    path = os.path.join(workdir, "loss.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
