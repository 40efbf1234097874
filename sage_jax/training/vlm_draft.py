"""A separate draft VLM for the home-trained VLM: the paper's setting, a small VLM of the target's family that sees a
pruned share of the visual tokens (`python -m sage_jax.train_vlm --config smollm2_vlm_draft`).

The draft is a LLaVA-OneVision with the target's tiles and patches (so it reads the same prompts) and

- its own tower: the target's first `tower_layers` SigLIP layers, fine-tuned (its features at that depth are not
  the last layer's the projector was fitted to: the projector and image_newline are fine-tuned with it);
- its own language model: the target LM's first `lm_layers` layers and final norm, fine-tuned, under the target's
  embedding and head, which it shares and does not store (`vlm_checkpoint.save_adapter` with `params["lm"]`).

Data: the target answers `rows` training images (the recipe's mix of sources and question templates; its greedy
answers are what speculative decoding must reproduce) and `heldout_rows` held-out Fashion-MNIST test images past
the bench's (`vlm_data.heldout_indices`); a video target also `clip_rows` training clips (`vlm_data.draw_clip`)
and `heldout_clips` held-out clips past the bench's, a `video_share` of the training batches being clips. Loss:
cross-entropy of the draft's next-token prediction on every answer token, with each row's visual tokens pruned at
a ratio drawn from `ratios` (the kept ones at random, so that neither the attention-based nor the uniform
selection of decoding is a surprise). A pruned token is masked out
as a key and the kept ones keep their positions, which is what decoding's compacted draft prompt computes.

    WORKDIR/data.npz, WORKDIR/heldout.npz          the target's answers (made once)
    WORKDIR/clips.npz, WORKDIR/heldout_clips.npz   the same for clips (a video target, `clip_rows` > 0)
    WORKDIR/draft_vlm/ckpt/, losses.json, evals.json  training (resumable, `loop.stage`); evals: held-out
                                                   teacher-forced agreement with the target at `eval_ratios`
    WORKDIR/vlm_draft/                             the draft (kind "vlm", around the default target)
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import checkpoint, provenance
from sage_jax.decoding.visual_pruning import keep_counts
from sage_jax.models import llava_onevision as lo
from sage_jax.models import serving_lm
from sage_jax.training import loop, vlm_data, vlm_head, vlm_model
from sage_jax.training.vlm_recipe import DraftVLMRecipe


def target(c: DraftVLMRecipe) -> tuple[str, vlm_model.Parts, dict]:
    """(path, parts, own params) of the VLM the draft learns from: one saved around the default target."""
    from sage_jax.io import loader, vlm_checkpoint

    path = loader.default_vlm() if c.target == "default" else c.target
    if path is None or not os.path.isdir(path):
        raise FileNotFoundError(f"no target VLM at {c.target!r}" if c.target != "default" else
                                "the shipped home VLM (sage_jax/assets/smollm2_vlm) is missing from this checkout")
    arch, cfg = vlm_checkpoint.read_config(path)
    if arch.name != "llava_onevision" or not vlm_checkpoint.uses_default_lm(path) or vlm_checkpoint.own_lm(path):
        raise ValueError(f"{path}: the draft VLM recipe distils a home-trained VLM (a LLaVA-OneVision around the "
                         "default target, `sage_jax.train_vlm --config smollm2_vlm`)")
    text_cfg, decoder, text_tok = loader.load_lm(loader.default_target())
    data = {"fashion": vlm_data.fashion("train"), "digits": vlm_data.digits(),
            "photos": vlm_data.photos(c.photo_crops, seed=c.seed)}
    parts = vlm_model.Parts(cfg=cfg, lm_params=decoder.params(), lm_serving=decoder.serving(),
                            tokenizer=vlm_model.tokenizer(text_tok), data=data)
    return path, parts, checkpoint.restore(path)


def config(c: DraftVLMRecipe, cfg: lo.LlavaOnevisionConfig) -> lo.LlavaOnevisionConfig:
    """The draft's config: the target's with `tower_layers` vision layers and `lm_layers` LM layers."""
    if c.tower_layers > cfg.vision.num_layers or c.lm_layers > cfg.text.n_layers:
        raise ValueError(f"the draft takes at most the target's {cfg.vision.num_layers} tower layers and "
                         f"{cfg.text.n_layers} LM layers, got {c.tower_layers} and {c.lm_layers}")
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, num_layers=c.tower_layers),
                               text=cfg.text.replace(n_layers=c.lm_layers))


def init_params(c: DraftVLMRecipe, parts: vlm_model.Parts, own: dict) -> dict:
    """The draft's trainable parameters, cut from the target's: tower layers, projector, image_newline, LM layers
    and final norm."""
    vision = {**own["vision"], "blocks": {k: v[: c.tower_layers] for k, v in own["vision"]["blocks"].items()}}
    lm = parts.lm_params
    return {"vision": vision, "projector": own["projector"], "image_newline": own["image_newline"],
            "blocks": {k: v[: c.lm_layers] for k, v in lm["blocks"].items()}, "final_norm": lm["final_norm"]}


def initial(c: DraftVLMRecipe, dcfg: lo.LlavaOnevisionConfig) -> dict:
    """The trainable parameters of the draft VLM `c.init`, checked to be of this recipe's shape."""
    from sage_jax.io import vlm_checkpoint

    if not os.path.isdir(c.init):
        raise FileNotFoundError(f"init: no draft VLM at {c.init}")
    _, got = vlm_checkpoint.read_config(c.init)
    if getattr(got, "vision", None) != dcfg.vision or getattr(got, "text", None) != dcfg.text:
        raise ValueError(f"init: {c.init} is not a draft VLM of this recipe's shape ({c.tower_layers} tower and "
                         f"{c.lm_layers} LM layers around the target's)")
    own = checkpoint.restore(c.init)
    return {"vision": own["vision"], "projector": own["projector"], "image_newline": own["image_newline"],
            "blocks": own["lm"]["blocks"], "final_norm": own["lm"]["final_norm"]}


# ------------------------------------------------------------------------------------------------------- data


def heldout_images(n: int) -> np.ndarray:
    """`n` held-out Fashion-MNIST dev images (no stage trains on them)."""
    return vlm_data.fashion("dev").pixels[vlm_data.heldout_indices(n, "dev")]


def clip_rollout(c: DraftVLMRecipe, parts: vlm_model.Parts, own: dict, n: int, progress: bool = False
                 ) -> dict[str, np.ndarray]:
    """`n` training clips (`vlm_data.draw_clip`, the train split) with video questions, answered by the target."""
    return vlm_head.clip_rollout(parts, own, n, np.random.default_rng([c.seed, 9]), c.max_new_tokens,
                                 progress=progress)


def _rows(path: str, make: Callable[[], dict]) -> dict[str, np.ndarray]:
    """`make()` once per work folder (the target's answers), written atomically."""
    if not os.path.isfile(path):
        rows = make()
        np.savez(path + ".partial.npz", **rows)
        os.replace(path + ".partial.npz", path)
    with np.load(path) as f:
        return dict(f)


def answer_targets(rows: dict[str, np.ndarray], width: int) -> dict[str, np.ndarray]:
    """Per row the slots that score an answer token ("where", [N, width]), that token ("target") and a weight."""
    n = len(rows["tokens"])
    where = np.zeros((n, width), np.int32)
    target = np.zeros((n, width), np.int32)
    weight = np.zeros((n, width), np.float32)
    for i in range(n):
        slots = np.flatnonzero(rows["answer"][i])[:width]
        where[i, : len(slots)] = slots
        target[i, : len(slots)] = rows["tokens"][i, slots + 1]
        weight[i, : len(slots)] = 1.0
    return {"where": where, "target": target, "weight": weight}


def keep_mask(tokens: np.ndarray, visual: int | tuple[int, ...], ratios: np.ndarray, rng: np.random.Generator
              ) -> np.ndarray:
    """[N, T] bool: the slots the draft sees: every text slot, and of each row's visual slots (the ids `visual`)
    the share left at its ratio (`keep_counts`, as decoding keeps), chosen at random."""
    keep = ~np.isin(tokens, visual)
    for i, r in enumerate(ratios):
        vis = np.flatnonzero(~keep[i])
        n_keep = keep_counts(len(vis), 0, (float(r), 0.0))[0]
        keep[i, rng.choice(vis, size=n_keep, replace=False)] = True
    return keep


def visual_ids(cfg: lo.LlavaOnevisionConfig) -> tuple[int, ...]:
    return tuple(x for x in (cfg.image_token_id, cfg.video_token_id) if x is not None)


def batch(rows: dict[str, np.ndarray], targets: dict[str, np.ndarray], idx: np.ndarray, keep: np.ndarray) -> dict:
    """Rows of images ("tiles", two a row) or of clips ("frames" [B, F, 3, 28, 28], no tiles)."""
    out = {"tokens": rows["tokens"][idx], "valid": rows["valid"][idx], "keep": keep,
           **{k: v[idx] for k, v in targets.items()}}
    if "clips" in rows:
        clips = rows["clips"][idx]
        frames = vlm_model.pixels(clips.reshape(-1, *clips.shape[2:]))[:, 0]
        return {**out, "tiles": np.zeros((0, 3, vlm_model.TILE, vlm_model.TILE), np.float32),
                "frames": frames.reshape(*clips.shape[:2], *frames.shape[1:])}
    return {**out, "tiles": vlm_model.pixels(rows["images"][idx]).reshape(-1, 3, vlm_model.TILE, vlm_model.TILE)}


# ------------------------------------------------------------------------------------------------------- loss


def logits(dcfg: lo.LlavaOnevisionConfig, params: dict, fz: dict, b: dict):
    """[B, A, V] the draft's next-token logits at the answer slots `b["where"]`, seeing the slots `b["keep"]`."""
    tokens, valid = b["tokens"], b["valid"]
    t = tokens.shape[1]
    own = {"vision": params["vision"], "projector": params["projector"], "image_newline": params["image_newline"],
           "lm": {"embed": fz["embed"]}}
    plan, tiles, frames, image_slots, video_slots = vlm_model.visual_inputs(dcfg, tokens, b["tiles"], b.get("frames"))
    x = lo.embed_inputs(dcfg, plan, own, tokens, tiles, frames, image_slots, video_slots)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)  # the target's, pruned or not
    seen = valid & b["keep"]
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & seen[:, None, :]) | jnp.eye(t, dtype=bool)[None]
    lm = serving_lm.serving_params(dcfg.text, {"embed": fz["embed"], "lm_head": fz.get("lm_head"),
                                               "blocks": params["blocks"], "final_norm": params["final_norm"]})
    hidden, _ = lm.forward(None, positions, mask, embeddings=x)
    return lm.head(jnp.take_along_axis(hidden, b["where"][..., None], axis=1)).astype(jnp.float32)


def loss(dcfg: lo.LlavaOnevisionConfig, params: dict, fz: dict, b: dict):
    out = logits(dcfg, params, fz, b)
    ce = optax.softmax_cross_entropy_with_integer_labels(out, b["target"])
    w = b["weight"]
    hit = (jnp.argmax(out, -1) == b["target"]) * w
    return (ce * w).sum() / w.sum(), {"acc": hit.sum() / w.sum()}


def agreement(dcfg, params: dict, fz: dict, rows: dict, targets: dict, ratio: float, seed: int,
              size: int = 16) -> float:
    """Teacher-forced top-1 agreement of the draft with the target's answers on `rows` at pruning `ratio` (the kept
    tokens drawn once per `seed`): the share of answer tokens a one-token draft would have accepted."""
    fn = jax.jit(lambda p, b: jnp.stack([((jnp.argmax(logits(dcfg, p, fz, b), -1) == b["target"]) * b["weight"]).sum(),
                                         b["weight"].sum()]))
    n = len(rows["tokens"])
    keep = keep_mask(rows["tokens"], visual_ids(dcfg), np.full(n, ratio), np.random.default_rng([seed, 7]))
    total = np.zeros(2)
    for i in range(0, n - n % size, size):  # whole batches: one compile
        idx = np.arange(i, i + size)
        total += np.asarray(fn(params, batch(rows, targets, idx, keep[idx])))
    return float(total[0] / max(total[1], 1.0))


# ----------------------------------------------------------------------------------------------------- recipe


def run(c: DraftVLMRecipe, workdir: str, *, progress: bool = True, log: Callable[[str], None] = loop.log_line
        ) -> dict:
    """Data, training and the export to WORKDIR/vlm_draft (module docstring); returns the summary."""
    t0 = time.perf_counter()
    path, parts, own = target(c)
    dcfg = config(c, parts.cfg)
    os.makedirs(workdir, exist_ok=True)
    log(f"draft VLM: {c.tower_layers} of {parts.cfg.vision.num_layers} tower layers, {c.lm_layers} of "
        f"{parts.cfg.text.n_layers} LM layers; the target ({path}) answers {c.rows} training images")
    rows = _rows(os.path.join(workdir, "data.npz"),
                 lambda: vlm_head.rollout(c, parts, own, c.rows, max_new=c.max_new_tokens, progress=progress))
    images = heldout_images(c.heldout_rows)
    held = _rows(os.path.join(workdir, "heldout.npz"), lambda: vlm_head.answer_rows(
        parts, own, images, [vlm_data.DEFAULT_QUESTION] * len(images), c.max_new_tokens, progress=progress))
    width = c.max_new_tokens
    sets = {"images": (rows, answer_targets(rows, width)), "held": (held, answer_targets(held, width))}
    if c.clip_rows:
        if parts.cfg.video_token_id is None:
            raise ValueError(f"clip_rows: the target {path} takes images only (no video token)")
        clips = _rows(os.path.join(workdir, "clips.npz"),
                      lambda: clip_rollout(c, parts, own, c.clip_rows, progress=progress))
        held_clips = _rows(os.path.join(workdir, "heldout_clips.npz"), lambda: vlm_head.answer_rows(
            parts, own, vlm_data.heldout_clips(c.heldout_clips, split="dev")[0],
            [vlm_data.VIDEO_QUESTION] * c.heldout_clips, c.max_new_tokens, progress=progress))
        sets.update(clips=(clips, answer_targets(clips, width)),
                    held_clips=(held_clips, answer_targets(held_clips, width)))
    lm = parts.lm_serving
    fz = {"embed": lm.embed, **({} if lm.lm_head is None else {"lm_head": lm.lm_head})}
    ratios = np.asarray(c.ratios, np.float64)

    def batch_fn(step: int) -> dict:
        rng = np.random.default_rng([c.seed, 8, step])
        on_clips = c.clip_rows and rng.random() < c.video_share
        data, targets = sets["clips" if on_clips else "images"]
        idx = rng.integers(len(data["tokens"]), size=c.train.batch_size)
        keep = keep_mask(data["tokens"][idx], visual_ids(dcfg), rng.choice(ratios, size=len(idx)), rng)
        return batch(data, targets, idx, keep)

    def evaluate(params, step):
        out = {str(r): agreement(dcfg, params, fz, *sets["held"], r, c.seed) for r in c.eval_ratios}
        if c.clip_rows:
            out.update({f"clips {r}": agreement(dcfg, params, fz, *sets["held_clips"], r, c.seed)
                        for r in c.eval_ratios})
        return out

    params0 = init_params(c, parts, own) if c.init is None else initial(c, dcfg)
    before = evaluate(params0, 0)
    log(f"held-out agreement before training (the target's first layers as they are): {before}")
    trained = loop.stage("draft_vlm", c.train, params0, lambda p, f, b: loss(dcfg, p, f, b), batch_fn, workdir,
                         frozen=fz, evaluate=evaluate, eval_label="held-out agreement", progress=progress,
                         log=log).params
    after = evaluate(trained, c.train.steps)
    out = export(c, dcfg, parts, trained, os.path.join(workdir, "vlm_draft"), path)
    summary = {"draft": out, "agreement_before": before, "agreement": after, "rows": c.rows,
               "heldout_rows": c.heldout_rows, "clip_rows": c.clip_rows, "heldout_clips": c.heldout_clips,
               "seconds": time.perf_counter() - t0, "recipe": c.to_json()}
    loop.write_json(os.path.join(workdir, "summary.json"), summary)
    log(f"held-out agreement with the target: {after}; the draft: {out}")
    return summary


def export(c: DraftVLMRecipe, dcfg, parts: vlm_model.Parts, params: dict, out: str, target_path: str) -> str:
    """The draft as our checkpoint: tower, projector, image_newline and its own LM layers and final norm, around
    the default target's embedding and head."""
    from sage_jax.io import vlm_checkpoint

    own = {"vision": params["vision"], "projector": params["projector"], "image_newline": params["image_newline"],
           "lm": {"blocks": params["blocks"], "final_norm": params["final_norm"]}}
    record = {"recipe": c.to_json(), "target": target_path, "target_sha256": provenance.checkpoint_sha256(target_path),
              "trained_by": "python -m sage_jax.train_vlm"}
    if c.init is not None:
        record["init_sha256"] = provenance.checkpoint_sha256(c.init)
    with tempfile.TemporaryDirectory() as proc:
        vlm_model.write_processor(proc)
        return vlm_checkpoint.save_adapter(out, dcfg, own, parts.tokenizer, proc, overwrite=True, provenance=record)
