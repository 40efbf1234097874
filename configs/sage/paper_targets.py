"""The paper's model pairs, the TPU slices they are served on and the accelerators' published figures, as data.

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
        # Per chip, as published (Cloud TPU system architecture pages; NVIDIA's data sheets, SXM parts): HBM GiB,
        # peak dense bf16 TFLOP/s, HBM GB/s, interconnect Gbit/s per chip (ICI; NVLink: 900 GB/s both ways).
        # The paper measured on H20s.
        chips={
            "v4": dict(hbm_gib=32.0, bf16_tflops=275.0, hbm_gbps=1228.0, link_gbits=2400.0),
            "v5e": dict(hbm_gib=16.0, bf16_tflops=197.0, hbm_gbps=819.0, link_gbits=1600.0),
            "v5p": dict(hbm_gib=95.0, bf16_tflops=459.0, hbm_gbps=2765.0, link_gbits=4800.0),
            "v6e": dict(hbm_gib=32.0, bf16_tflops=918.0, hbm_gbps=1640.0, link_gbits=3584.0),
            "h100": dict(hbm_gib=80.0, bf16_tflops=989.0, hbm_gbps=3350.0, link_gbits=3600.0),
            "h200": dict(hbm_gib=141.0, bf16_tflops=989.0, hbm_gbps=4800.0, link_gbits=3600.0),
            "h20": dict(hbm_gib=96.0, bf16_tflops=148.0, hbm_gbps=4000.0, link_gbits=3600.0),
        },
        # slice: TPU generation and chip count; tp: the mesh's `model` axis.
        # reported: the paper's SAGE row of the pair on VideoDetailedCaption (Tables 1 and 2, T = 0, H20 GPUs):
        # τ (accepted draft tokens per step, the bonus token not counted), tokens/s, and AR's tokens/s.
        presets=(
            dict(name="qwen2.5-vl-72b+7b", target=QWEN_72B, draft=QWEN_7B, slice="v6e-8", tp=8, dtype="bfloat16",
                 reported=dict(benchmark="VideoDetailedCaption", tau=5.18, tok_s=15.87, ar_tok_s=4.99)),
            dict(name="llava-ov-72b+7b", target=LLAVA_72B, draft=LLAVA_7B, slice="v6e-8", tp=8, dtype="bfloat16",
                 reported=dict(benchmark="VideoDetailedCaption", tau=5.74, tok_s=15.75, ar_tok_s=4.69)),
            dict(name="qwen2.5-vl-72b+7b-v5p", target=QWEN_72B, draft=QWEN_7B, slice="v5p-8", tp=4,
                 dtype="bfloat16"),
            dict(name="qwen2.5-vl-7b", target=QWEN_7B, draft=None, slice="v5e-4", tp=4, dtype="bfloat16"),
            dict(name="llava-ov-7b", target=LLAVA_7B, draft=None, slice="v5e-4", tp=4, dtype="bfloat16"),
        ),
    ))
