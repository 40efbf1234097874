"""VLMs through `sage_jax.load` and `python -m sage_jax.convert`: an HF directory (sharded by `save_pretrained`,
with its tokenizer and image processor) and the checkpoint converted from it give transformers' logits; the
conversion streams (peak memory measured); bad inputs give one-line errors and exit code 2."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import sage_jax
from sage_jax import convert
from sage_jax.bench import tiny_vlm
from sage_jax.io.vision_lm import VisionLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = tiny_vlm.VOCAB


def _tokenizer(family):
    """The tiny VLMs' tokenizer (special ids 0..8, a chat template with the family's placeholders)."""
    return tiny_vlm.vlm_tokenizer({"qwen": "qwen2_5_vl", "llava": "llava_onevision"}[family])


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _qwen():
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6, tie_word_embeddings=False)
    ip = transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    return _perturbed(transformers.Qwen2_5_VLForConditionalGeneration(cfg)), ip


def _llava():
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    cfg = transformers.LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=2, pad_token_id=0),
        image_token_index=7, video_token_index=8, vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_grid_pinpoints=pinpoints, vision_aspect_ratio="anyres_max_9", tie_word_embeddings=False)
    ip = transformers.LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints,
                                                   do_pad=True)
    return _perturbed(transformers.LlavaOnevisionForConditionalGeneration(cfg)), ip


@pytest.fixture(scope="module", params=["qwen", "llava"])
def hf_vlm(request, tmp_path_factory):
    """(family, HF directory sharded into many files with tokenizer and image processor, the PyTorch model)."""
    ref, ip = {"qwen": _qwen, "llava": _llava}[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, max_shard_size="40KB")
    _tokenizer(request.param).save_pretrained(path)
    ip.save_pretrained(path)
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) > 20
    return request.param, str(path), ref


def _image(h, w, seed=0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _reference_logits(ref, inputs):
    kw = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
    with torch.no_grad():
        return ref(**kw).logits.numpy()


def test_bfloat16_logits_follow_float32(hf_vlm, rel_err):
    """Both families loaded with `dtype="bfloat16"` (language model and vision tower in bf16; norms, RoPE, attention
    scores and logits in float32): logits with images within 5% of the float32 model's scale, the same next token
    at >= 90% of positions."""
    family, path, _ = hf_vlm
    m32, m16 = sage_jax.load(path), sage_jax.load(path, dtype="bfloat16")
    assert m16.config.text.dtype == "bfloat16"
    inputs = m32.inputs("Describe the pictures.", images=[_image(56, 84, 1), _image(70, 42, 2)])
    l32, l16 = np.asarray(m32(**inputs))[0], np.asarray(m16(**inputs), np.float32)[0]
    err, agree = rel_err(l16, l32), float(np.mean(l16.argmax(-1) == l32.argmax(-1)))
    print(f"{family}: bf16 vs float32 logits rel err {err:.3f}, top-1 agreement {agree:.2f}")
    assert err <= 0.05 and agree >= 0.9


def test_load_and_convert_give_the_reference_logits(hf_vlm, tmp_path, rel_err, capsys):
    family, path, ref = hf_vlm
    model = sage_jax.load(path)
    assert isinstance(model, VisionLM) and model.architecture == {"qwen": "qwen2_5_vl", "llava": "llava_onevision"}[
        family]
    images = [_image(56, 84, 1), _image(70, 42, 2)] + ([_image(1, 300, 3)] if family == "llava" else [])
    inputs = model.inputs("Describe the pictures.", images=images)
    ours = np.asarray(model(**inputs))
    err = rel_err(ours, _reference_logits(ref, inputs))
    print(f"{family}: sage_jax.load(HF dir) logits rel err {err:.1e}, prompt of {inputs['input_ids'].shape[1]} tokens")
    assert err <= 1e-4

    out = tmp_path / "ckpt"
    assert convert.main([path, str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert sorted(os.listdir(out)) == ["SHA256SUMS", "metadata.json", "params", "processor", "tokenizer"]
    converted = sage_jax.load(out)
    again = converted.inputs("Describe the pictures.", images=images)
    assert all(np.array_equal(again[k], inputs[k]) for k in inputs)
    np.testing.assert_array_equal(np.asarray(converted(**again)), ours)
    assert convert.main([path, str(out)]) == 2  # never overwritten without --force
    assert "exists" in capsys.readouterr().err
    # Streamed onto a tensor-parallel mesh (from the HF directory) and restored onto it (from our checkpoint).
    from configs import sharding

    mesh = sharding.make_mesh(data=1, model=2, devices=jax.devices()[:2])
    for spec in (path, out):
        placed = sage_jax.load(spec, mesh=mesh)
        wq = placed.module.lm.blocks.wq[...]
        assert wq.sharding.spec == jax.P(None, None, "model", None), wq.sharding
        assert rel_err(np.asarray(placed(**inputs)), ours) <= 1e-5


def test_serving_load_holds_one_copy_of_the_language_model(hf_vlm, tmp_path):
    """Our checkpoint loaded as an engine loads it (`loader.load_vision_serving`): the language model built in
    serving form while restoring, the module's language-model layers empty, its embedding and head the serving
    form's own arrays; the serving layers, logits and greedy continuation those of `sage_jax.load`."""
    from sage_jax.io import loader

    family, path, _ = hf_vlm
    out = tmp_path / "ckpt"
    assert convert.main([path, str(out)]) == 0
    full, one = sage_jax.load(out), loader.load_vision_serving(out)
    assert all(x.shape == (0,) for x in jax.tree.leaves(one.module.lm.blocks))
    serving = one.serving()
    assert one.module.lm.embed[...] is serving.embed
    ref = full.serving()
    for got, want in zip(serving.layers, ref.layers, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    inputs = full.inputs("Describe the picture.", images=[_image(56, 84, 1)])
    np.testing.assert_array_equal(np.asarray(one(**inputs)), np.asarray(full(**inputs)))
    np.testing.assert_array_equal(one.generate(max_new_tokens=4, **inputs), full.generate(max_new_tokens=4, **inputs))
    assert loader.load_vision_serving(path).serving().n_layers == 2  # an HF directory: read, then fused
    # An exact engine on a tensor-parallel mesh serves through the o and down projections re-laid on their output
    # rows (`serving_lm.exact_layout`), and its model holds them once; the caller's keeps its own.
    from configs import sharding
    from sage_jax.engine import Engine

    placed = loader.load_vision_serving(out, mesh=sharding.make_mesh(data=1, model=2, devices=jax.devices()[:2]))
    engine = Engine(placed, matmul="exact")
    assert engine.target is engine.vision and engine.vision.serving() is engine.target_lm
    o = engine.target_lm.layers[0]["o"]
    assert o.sharding.spec[0] is not None and placed.serving().layers[0]["o"].sharding.spec[0] is None


def test_bad_inputs_give_one_line_errors(hf_vlm, tmp_path, capsys):
    family, path, _ = hf_vlm
    model = sage_jax.load(path)
    truncated = tmp_path / "cut.png"
    _image(56, 56).save(tmp_path / "whole.png")
    truncated.write_bytes((tmp_path / "whole.png").read_bytes()[:200])
    (tmp_path / "text.png").write_text("not an image")
    for bad in (truncated, tmp_path / "text.png"):
        with pytest.raises(ValueError, match="not a readable image|not an image file") as e:
            model.inputs("Describe.", images=[bad])
        assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such image file"):
        model.inputs("Describe.", images=[tmp_path / "missing.png"])
    # A prompt with one image placeholder and two images.
    one_slot = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    with pytest.raises(ValueError, match="fewer") as e:
        model.inputs(one_slot, images=[_image(56, 56), _image(56, 56, 3)])
    assert "\n" not in str(e.value)
    # The model itself refuses placeholder / image mismatches in processor outputs made elsewhere.
    inputs = model.inputs("Describe.", images=[_image(56, 56)])
    ids = inputs["input_ids"]
    image_id = model.config.image_token_id
    with pytest.raises(ValueError) as e:
        model(**{**inputs, "input_ids": np.where(ids == image_id, 9, ids)})
    assert "\n" not in str(e.value)
    if family == "qwen":  # its processor refuses an aspect ratio over 200 (LLaVA's tiles it: tested above)
        with pytest.raises(ValueError, match="cannot take.*aspect ratio") as e:
            model.inputs("Describe.", images=[_image(1, 300)])
        assert "\n" not in str(e.value)


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    from safetensors.numpy import save_file

    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    save_file({"wte.weight": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    assert convert.main([str(d), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unsupported architecture 'GPT2LMHeadModel'" in err, err
    with pytest.raises(ValueError, match="Qwen2.5-VL, LLaVA-OneVision"):
        sage_jax.load(d)
    assert not (tmp_path / "out").exists()


def _qwen_sized(vocab, width, layers, mlp, sections):
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": sections}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width,
                           fullatt_block_indexes=[1]),
        tie_word_embeddings=False)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def test_conversion_streams_one_parameter_at_a_time(tmp_path):
    """A 181 MB checkpoint in 37 MB shards converts with a peak host memory (over the process's memory before
    the conversion) under 2x its largest shard: a stored tensor is read, transformed and written chunk by chunk
    before the next is read, and the model is never in memory whole (reading it first would need the checkpoint's
    size at least)."""
    big, small = tmp_path / "big", tmp_path / "small"
    _qwen_sized(16384, 512, 8, 2048, [8, 12, 12]).save_pretrained(big, max_shard_size="40MB")
    _qwen_sized(256, 64, 1, 128, [2, 1, 1]).save_pretrained(small)
    shards = [f for f in os.listdir(big) if f.endswith(".safetensors")]
    largest = max(os.path.getsize(big / f) for f in shards)
    total = sum(os.path.getsize(big / f) for f in shards)
    assert len(shards) >= 5 and total > 4 * largest
    script = textwrap.dedent(f"""
        import json, threading, time
        from sage_jax.io import vlm_checkpoint

        def rss():
            with open("/proc/self/status") as f:
                return {{l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "VmHWM"))}}

        vlm_checkpoint.convert_hf({str(small)!r}, {str(tmp_path / "small_out")!r})  # imports, Orbax, first compiles
        base = rss()["VmRSS"]
        peak = [base]
        stop = threading.Event()

        def sample():  # the kernel's high-water mark cannot always be reset, so also sample
            while not stop.is_set():
                peak[0] = max(peak[0], rss()["VmRSS"])
                time.sleep(0.002)

        t = threading.Thread(target=sample)
        t.start()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            reset = True
        except OSError:
            reset = False
        vlm_checkpoint.convert_hf({str(big)!r}, {str(tmp_path / "big_out")!r})
        stop.set()
        t.join()
        if reset:
            peak[0] = max(peak[0], rss()["VmHWM"])
        print(json.dumps({{"base": base, "peak": peak[0]}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["base"]
    print(f"conversion of {total / 2**20:.0f} MB in {len(shards)} shards (largest {largest / 2**20:.0f} MB): "
          f"peak host memory +{grown / 2**20:.0f} MB")
    assert grown < 2 * largest, (grown, largest, total)
    ours = sage_jax.load(tmp_path / "big_out")
    ids = np.array([[5, 6, 7, 8]])
    assert np.isfinite(np.asarray(ours(input_ids=ids))).all()


def test_readme_vlm_example_runs(hf_vlm, tmp_path, rel_err, monkeypatch):
    """The VLM snippets as written, on a tiny Qwen2.5-VL directory: docs/vlm.md's (transformers' image processor and
    `model.inputs`) and the README's load / inputs / call lines; their logits are transformers'."""
    family, path, ref = hf_vlm
    if family != "qwen":
        pytest.skip("the docs show Qwen2.5-VL")
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    docs = open(os.path.join(root, "docs", "vlm.md")).read()
    code = next(b for b in docs.split("```python")[1:] if "Qwen2.5-VL-7B-Instruct" in b).split("```")[0]
    _image(70, 98, 5).save(tmp_path / "cat.png")
    monkeypatch.chdir(tmp_path)
    scope = {"sage_jax": sage_jax}
    exec(code.replace("path/to/Qwen2.5-VL-7B-Instruct", path), scope)  # noqa: S102 (our own docs)
    np.testing.assert_array_equal(scope["inputs"]["input_ids"], scope["ids"]["input_ids"])
    assert rel_err(np.asarray(scope["logits"]), _reference_logits(ref, scope["inputs"])) <= 1e-4
    assert scope["tokens"].shape == (1, 32)

    readme = open(os.path.join(root, "README.md")).read()
    block = next(b for b in readme.split("```python")[1:] if "Qwen2.5-VL-7B-Instruct" in b).split("```")[0]
    lines = [ln for ln in block.splitlines() if ln.startswith(("vlm = ", "inputs = vlm.", "logits = vlm("))]
    assert len(lines) == 3, lines
    mine = {"sage_jax": sage_jax}
    exec("\n".join(lines).replace("path/to/Qwen2.5-VL-7B-Instruct", path), mine)  # noqa: S102
    np.testing.assert_array_equal(mine["inputs"]["input_ids"], scope["inputs"]["input_ids"])
    assert rel_err(np.asarray(mine["logits"]), _reference_logits(ref, mine["inputs"])) <= 1e-4


def _generate_cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one host device, as a user has
    return subprocess.run([sys.executable, "-m", "sage_jax.generate", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.integration
def test_generate_cli_refuses_bad_vlm_inputs(hf_vlm, tmp_path):
    """An image the processor refuses and an unsupported architecture give exit 2 and one line."""
    family, path, _ = hf_vlm
    _image(56, 84, 1).save(tmp_path / "a.png")
    bad = []
    if family == "qwen":
        _image(1, 300).save(tmp_path / "wide.png")
        bad.append((["--target", path, "--image", str(tmp_path / "wide.png")], "cannot take"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    bad.append((["--target", str(gpt2), "--image", str(tmp_path / "a.png")], "unsupported architecture"))
    for args, needle in bad:
        proc = _generate_cli(*args, "--json")
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


# 90 s on 2 cores; converted VLM checkpoints are decoded through the CLI under -m integration (test_generate.py's
# README command), HF directories through `load` in the default suite (above).
@pytest.mark.slow
def test_generate_cli_decodes_an_hf_vlm_directory(hf_vlm, tmp_path):
    """`python -m sage_jax.generate --target HF_DIR --draft HF_DIR --image ...` decodes with SAGE and draft-side
    pruning: tokens equal to the model's own greedy `generate`, one JSON object."""
    family, path, _ = hf_vlm
    if family != "qwen":
        pytest.skip("one family decodes an HF directory through the CLI")
    _image(56, 84, 1).save(tmp_path / "a.png")
    proc = _generate_cli("--target", path, "--draft", path, "--image", str(tmp_path / "a.png"), "--prompt",
                         "Describe.", "--max-new-tokens", "8", "--budget", "static", "--prune-ratio", "0.5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    model = sage_jax.load(path)
    want = model.generate(max_new_tokens=8, **model.inputs("Describe.", images=[tmp_path / "a.png"]))[0].tolist()
    eos = set(model.config.text.eos_token_ids)
    want = next((want[: i + 1] for i, t in enumerate(want) if t in eos), want)
    assert out["token_ids"] == want and out["policy"] == "sage" and out["stats"]["new_tokens"] == len(want)
    st = out["stats"]
    assert st["draft_prompt_tokens"] < st["prompt_tokens"] and st["draft_forwards"] > st["steps"]
