"""The paper's model pairs and the TPU slices they are served on, as data.

SAGE evaluates Qwen2.5-VL-72B and LLaVA-OneVision-72B targets with 7B drafts of the same family. Each preset serves
its target (and draft) tensor-parallel `tp` ways over the mesh's `model` axis (a (data, fsdp, model) mesh of
(1, 1, tp) chips) with no FSDP, in `dtype`. `sage_jax.io.paper_targets` builds the models' configs from these names,
places their parameters and counts the memory per chip (``python -m sage_jax.lowering --memory-table``).
"""

import ml_collections

QWEN_72B, QWEN_7B = dict(family="qwen2_5_vl", size="72b"), dict(family="qwen2_5_vl", size="7b")
LLAVA_72B, LLAVA_7B = dict(family="llava_onevision", size="72b"), dict(family="llava_onevision", size="7b")


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="paper_targets",
        # HBM per chip, GiB (Cloud TPU documentation).
        hbm_gib={"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0},
        # slice: TPU generation and chip count; tp: the mesh's `model` axis.
        presets=(
            dict(name="qwen2.5-vl-72b+7b", target=QWEN_72B, draft=QWEN_7B, slice="v6e-8", tp=8, dtype="bfloat16"),
            dict(name="llava-ov-72b+7b", target=LLAVA_72B, draft=LLAVA_7B, slice="v6e-8", tp=8, dtype="bfloat16"),
            dict(name="qwen2.5-vl-72b+7b-v5p", target=QWEN_72B, draft=QWEN_7B, slice="v5p-8", tp=4,
                 dtype="bfloat16"),
            dict(name="qwen2.5-vl-7b", target=QWEN_7B, draft=None, slice="v5e-4", tp=4, dtype="bfloat16"),
            dict(name="llava-ov-7b", target=LLAVA_7B, draft=None, slice="v5e-4", tp=4, dtype="bfloat16"),
        ),
    ))
