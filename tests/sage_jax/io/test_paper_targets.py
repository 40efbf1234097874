"""The paper presets (`sage_jax.io.paper_targets` over the data of `configs/sage/paper_targets.py`): published sizes,
memory per chip within HBM, and a 72B layer's sharded program lowering for TPU from this CPU (abstract arrays on an
abstract 8-chip mesh, nothing allocated)."""

import dataclasses
import glob
import os
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from configs import sharding
from sage_jax.io import paper_targets

# Parameter counts on the models' HF cards (billions).
PUBLISHED = {"qwen2.5-vl-7b": 8.29, "llava-ov-7b": 8.03, "qwen2.5-vl-72b+7b": 73.4 + 8.29,
             "llava-ov-72b+7b": 73.2 + 8.03}


def test_presets_have_the_published_sizes_and_fit_their_chips():
    presets = paper_targets.presets()
    for name, billions in PUBLISHED.items():
        m = paper_targets.memory_per_chip(presets[name], batch=1, context=8192)
        assert m["params_b"] == pytest.approx(billions, rel=5e-3), name
    for p in presets.values():
        m = paper_targets.memory_per_chip(p, batch=1, context=8192)  # the paper decodes batch 1
        assert m["total_gib"] < 0.8 * m["hbm_gib"], (p.name, m)  # room for activations and the tree's buffers
        # Tensor parallelism really splits the target: its weights per chip are about a tp-th of the whole.
        solo = dataclasses.replace(p, draft=None)
        assert paper_targets.memory_per_chip(solo)["weights_gib"] < 1.1 * (
            paper_targets.memory_per_chip(dataclasses.replace(solo, tp=1))["weights_gib"] / p.tp)


ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_the_docs_show_this_table():
    """The README or a page of docs/ shows the table as `python -m sage_jax.lowering --memory-table` prints it."""
    pages = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    table = paper_targets.table()
    assert any(table in open(p, encoding="utf-8").read() for p in pages)  # regenerate with the command above


def test_the_data_names_every_preset_s_models():
    presets = paper_targets.presets()
    assert set(presets) == {"qwen2.5-vl-72b+7b", "llava-ov-72b+7b", "qwen2.5-vl-72b+7b-v5p", "qwen2.5-vl-7b",
                            "llava-ov-7b"}
    p = presets["qwen2.5-vl-72b+7b"]
    assert (p.target, p.draft, p.chips, p.tp, p.dtype) == (paper_targets.Model("qwen2_5_vl", "72b"),
                                                          paper_targets.Model("qwen2_5_vl", "7b"), 8, 8, "bfloat16")
    assert paper_targets.hbm_gib(p.generation) == 32.0
    with pytest.raises(ValueError, match="no qwen2_5_vl model of size '3b'"):
        paper_targets.Model("qwen2_5_vl", "3b").build_config()


def test_a_72b_layer_lowers_for_a_tpu_slice():
    from sage_jax.models import layers
    from sage_jax.models.serving_lm import serving_params

    preset = paper_targets.presets()["qwen2.5-vl-72b+7b"]
    arch, cfg = preset.target.build_config()
    text = cfg.text.replace(n_layers=1)  # one real-sized layer: the sharding of every layer is the same
    mesh = paper_targets.abstract_mesh(preset.tp)
    from sage_jax.models.decoder import Decoder

    _, state = nnx.split(nnx.eval_shape(lambda: Decoder(text, rngs=nnx.Rngs(0))))
    shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(state), shardings)
    assert params["blocks"]["wq"].sharding.spec[2] == "model" and params["blocks"]["w_gate"].sharding.spec[2] == "model"
    b, t = 1, 16

    def forward(params, tokens, positions):
        lm = serving_params(text, params)
        mask = layers.causal_mask(t, jnp.zeros((b,), jnp.int32))
        with sharding.use(mesh):
            hidden, _ = lm.forward(tokens, positions, mask)
        return lm.head(hidden)

    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(mesh, jax.P()))
    positions = jax.ShapeDtypeStruct((b, t, 3), jnp.int32, sharding=NamedSharding(mesh, jax.P()))
    exported = jax.export.export(jax.jit(forward), platforms=["tpu"])(params, tokens, positions)
    assert exported.nr_devices == preset.tp
    # Every matrix of the layer enters the TPU program split over the 8-way `model` axis (tensor parallel).
    split = set(re.findall(r'sdy\.sharding<@mesh, \[[^\]]*"model"[^\]]*\]>\} loc\("params\[\'blocks\'\]\[\'(\w+)\'\]',
                           exported.mlir_module()))
    assert {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} <= split, split
