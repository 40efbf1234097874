"""Online distillation: the target's features computed inside the training step, from token rows alone.

On an accelerator one target forward over a batch costs less than reading its cached features back (a SmolLM2-135M
row of 256 tokens holds 0.6 MB of float32 features), so a row needs only its tokens: `data.py`'s layout without
`features` (tokens, lengths, answer_start, kind), e.g. `distillation.answer_rows`. The frozen target rides in the
frozen inputs of the jitted step (`frozen`: its serving form under "target"), `with_features` runs it over the batch
and adds what the shard path stores (`features.py`: the head's input features, the last hidden state, the argmax),
and any `objectives.Task`'s loss and agreement then run unchanged (`task`). So `loop.train` trains, checkpoints and
resumes exactly as on cached features; only the data are never written to disk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sage_jax.models import layers
from sage_jax.models.serving_lm import LM
from sage_jax.training import objectives


def target_features(model: LM, tokens: Int[Array, "B T"], taps: tuple[int, ...] = ()
                    ) -> tuple[Float[Array, "B T Z"], Float[Array, "B T D"], Int[Array, "B T"]]:
    """(the inputs of the layers `taps` names, concatenated, or without taps the last hidden state; the last
    hidden state before the final norm; the full-vocabulary argmax) of right-padded rows, each attending causally
    from slot 0 (padding after a row's end changes nothing before it)."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = model.forward(tokens, pos, layers.causal_mask(t, jnp.zeros((b,), jnp.int32)), taps=taps)
    hidden = out[0]
    top = jnp.argmax(model.head(hidden), -1).astype(jnp.int32)
    return (out[-1] if taps else hidden), hidden, top


def frozen(target: LM, vocab_ids=None) -> dict:
    """`objectives.frozen_target` plus the whole target (serving form) under "target", for `with_features`."""
    return {**objectives.frozen_target(target, vocab_ids), "target": target}


def with_features(fz: dict, batch: dict, taps: tuple[int, ...] = ()) -> dict:
    """`batch` with the target's `features`, `hidden` and `top` (`target_features`; no gradient flows into the
    target)."""
    feats, hidden, top = jax.lax.stop_gradient(target_features(fz["target"], batch["tokens"], taps))
    return {**batch, "features": feats, "hidden": hidden, "top": top}


def task(inner: objectives.Task, taps: tuple[int, ...] = ()) -> objectives.Task:
    """`inner` on rows without features: its loss and agreement see the target's, computed in the step."""
    return objectives.Task(inner.name, lambda p, f, b: inner.loss(p, f, with_features(f, b, taps)),
                      lambda p, f, b: inner.agreement(p, f, with_features(f, b, taps)))
