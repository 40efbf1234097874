"""How well a home-trained VLM's vision tower reads the frames of a clip: a clip slides each item across the frame one
pixel a frame (`vlm_data.clip`: shifts -4 … +3), and a tower that never saw shifted images may not read them.

    python benchmarks/sage/vlm_tower_shifts.py [--vlm DIR | --workdir W] [--images 3000]
                                               [--out benchmarks/sage/results/vlm_home/tower_shifts.json]

A logistic-regression probe (scikit-learn) is fitted on the tower's mean-pooled features of 20,000 training
Fashion-MNIST images (unshifted), then reads `--images` dev images (the train split's last rows, which no stage trains
on) at each of the clip's shifts; the table gives the accuracy at each shift and that of the eight shifts' averaged
probabilities (what a reader of all of an item's frames could reach from the probe alone). `--vlm DIR`: a trained VLM
(default: the shipped one); `--workdir W`: the tower stage's last checkpoint in a `train_vlm` work folder (with the
recipe in W/settings.json). Writes OUT (JSON, with what produced it) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from configs import provenance  # noqa: E402


def clip_shifts() -> tuple[int, ...]:
    """The shifts of an item's frames in a clip (`vlm_data.clip`): -4 … +3 with 8 frames an item."""
    from sage_jax.training import vlm_data

    half = vlm_data.FRAMES_PER_ITEM // 2
    return tuple(range(-half, vlm_data.FRAMES_PER_ITEM - half))


def tower_of(args):
    """(vision config, tower params) of `--vlm` or of `--workdir`'s tower stage."""
    from configs import checkpoint
    from sage_jax.io import vlm_checkpoint
    from sage_jax.training import loop, vlm_stages
    from sage_jax.training.vlm_recipe import VLMRecipe

    if args.workdir is None:
        _, cfg = vlm_checkpoint.read_config(args.vlm)
        return cfg.vision, checkpoint.restore(args.vlm)["vision"]
    with open(os.path.join(args.workdir, "settings.json")) as f:
        c = VLMRecipe.from_config(json.load(f)["recipe"])
    tower_dir = os.path.join(args.workdir, "tower")
    step = max(loop.saved_steps(tower_dir))
    import jax.numpy as jnp
    from flax import nnx

    from sage_jax.models.siglip import SiglipVision

    fresh = nnx.to_pure_dict(nnx.state(SiglipVision(c.vision, rngs=nnx.Rngs(c.seed)), nnx.Param))
    probe = {"w": jnp.zeros((c.vision.hidden_size, vlm_stages.N_PROBE)), "b": jnp.zeros(vlm_stages.N_PROBE)}
    got = loop.saved_params(tower_dir, step, {"vision": fresh, "probe": probe}, loop.optimizer(c.tower))
    return c.vision, got["vision"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--vlm", help="a trained VLM directory (default: the shipped one)")
    which.add_argument("--workdir", help="a train_vlm work folder: its tower stage's last checkpoint")
    ap.add_argument("--images", type=int, default=3000, help="dev images read at each shift")
    ap.add_argument("--out", default="benchmarks/sage/results/vlm_home/tower_shifts.json")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from sage_jax.io import loader
    from sage_jax.models.siglip import hidden_states
    from sage_jax.training import vlm_data, vlm_model

    if args.workdir is None:
        args.vlm = args.vlm or loader.default_vlm()
    record = provenance.record("python benchmarks/sage/vlm_tower_shifts.py", argv if argv is not None else sys.argv[1:],
                               {} if args.workdir else {"vlm": args.vlm})
    vision, params = tower_of(args)
    params = jax.tree.map(jnp.asarray, params)
    pooled = jax.jit(lambda x: hidden_states(vision, params, x, (-1,))[0].mean(1))

    def features(images):
        return np.concatenate([np.asarray(pooled(vlm_model.pixels(images[i: i + 500])[:, 0]))
                               for i in range(0, len(images), 500)])

    train, dev = vlm_data.fashion("train"), vlm_data.fashion("dev")
    rows = np.random.default_rng(0).choice(len(train), 20_000, replace=False)
    probe = LogisticRegression(max_iter=2000).fit(features(train.pixels[rows]), train.labels[rows])
    idx = vlm_data.heldout_indices(args.images, "dev")
    images, labels = dev.pixels[idx], dev.labels[idx]
    shifts = clip_shifts()
    probs = {dx: probe.predict_proba(features(vlm_data.shifted(images, dx))) for dx in shifts}
    acc = {str(dx): float(np.mean(p.argmax(1) == labels)) for dx, p in probs.items()}
    mean = float(np.mean(np.mean(list(probs.values()), axis=0).argmax(1) == labels))
    out = {"per_shift": acc, "all_frames": mean, "images": args.images,
           "source": args.workdir or args.vlm, "provenance": record}
    print("| shift (px) | " + " | ".join(str(dx) for dx in shifts) + f" | the {len(shifts)} averaged |")
    print("|---" * (len(shifts) + 2) + "|")
    print("| dev accuracy | " + " | ".join(f"{acc[str(dx)]:.1%}" for dx in shifts) + f" | {mean:.1%} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
