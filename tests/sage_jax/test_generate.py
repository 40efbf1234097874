"""`python -m sage_jax.generate` as a user runs it (a subprocess): the --json contract on a tiny random Llama,
--compare, and every bad input -> exit 2 with one line on stderr."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STATS_KEYS = {"new_tokens", "steps", "target_forwards", "draft_forwards", "mean_accepted", "mean_tokens_per_step",
              "tokens_per_second", "compiles", "alpha_trace"}


def _tiny_llama(path, vocab_size, tokenizer=None, **kw):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # confident next-token distributions, so SAGE builds real trees (not empty ones)
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """An HF directory: a random 2-layer Llama (context 512) + a byte-level BPE tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["speculative decoding drafts a tree of tokens and the target verifies it in one forward pass"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    hf_tok.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("tiny_llama")
    return _tiny_llama(path, len(hf_tok), hf_tok, eos_token_id=hf_tok.eos_token_id,
                       pad_token_id=hf_tok.pad_token_id, bos_token_id=None)


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory):
    """The subprocesses' environment: one host device (as a user has), a session-wide compilation cache."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    return env


def _cli(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sage_jax.generate", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # exactly one JSON object, nothing else
    out = json.loads(lines[0])
    assert {"text", "token_ids", "policy", "stats"} <= out.keys()
    assert STATS_KEYS <= out["stats"].keys()
    assert isinstance(out["text"], str) and all(isinstance(t, int) for t in out["token_ids"])
    assert out["stats"]["new_tokens"] == len(out["token_ids"])
    return out


@pytest.mark.integration
def test_tiny_json_greedy_sage_equals_ar(tiny_target, cli_env):
    common = ["--target", tiny_target, "--draft-layers", "1", "--max-new-tokens", "8", "--json", "--prompt", "tree"]
    ar = _json(_cli(cli_env, *common, "--policy", "ar"))
    sage = _json(_cli(cli_env, *common, "--compare"))  # default policy sage, plus plain AR in the same process
    assert ar["policy"] == "ar" and sage["policy"] == "sage"
    assert len(ar["token_ids"]) == 8  # a random model rarely says EOS; if it did, the lengths below still agree
    assert sage["token_ids"] == ar["token_ids"]
    assert sage["stats"]["draft_forwards"] > 0 and len(sage["stats"]["alpha_trace"]) == sage["stats"]["steps"]
    assert sage["stats"]["mean_accepted"] > 0  # the trees were non-trivial and some of them were accepted
    cmp = sage["compare"]
    assert cmp["policy"] == "ar" and cmp["token_ids"] == ar["token_ids"] and cmp["identical"] is True
    for st in (sage["stats"], cmp["stats"], cmp["policy_stats"]):  # decode rate = the loop's tokens / time
        assert st["tokens_per_second"] == pytest.approx((st["new_tokens"] - 1) / st["decode_seconds"])
    # The speedup compares second runs of each, which compile nothing.
    assert cmp["stats"]["compile_seconds"] == cmp["policy_stats"]["compile_seconds"] == 0
    assert cmp["policy_tokens_per_second"] == cmp["policy_stats"]["tokens_per_second"]
    assert cmp["speedup"] == pytest.approx(cmp["policy_tokens_per_second"] / cmp["tokens_per_second"])


@pytest.mark.integration
def test_tiny_text_output_with_compare(tiny_target, cli_env):
    # The same run as the --json test above, so its executables come from the session's compilation cache.
    proc = _cli(cli_env, "--target", tiny_target, "--draft-layers", "1", "--max-new-tokens", "8", "--compare",
                "--prompt", "tree")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").split("\n")
    assert len(lines) == 3, proc.stdout  # answer, stats summary, compare line
    assert "tokens in" in lines[1] and "tok/s" in lines[1]
    assert lines[2].startswith("compare (second runs): sage ") and "speedup" in lines[2] and "differ" not in lines[2]
    assert "generating with policy sage" in proc.stderr  # progress goes to stderr


@pytest.mark.integration
def test_tiny_separate_draft(tiny_target, cli_env):
    """--draft SPEC: the target drafting for itself accepts whole greedy paths and still matches AR."""
    out = _json(_cli(cli_env, "--target", tiny_target, "--draft", tiny_target, "--policy", "eagle2",
                     "--max-new-tokens", "8", "--prompt", "tree", "--compare", "--json"))
    assert out["policy"] == "eagle2" and out["compare"]["identical"] is True
    assert out["stats"]["mean_accepted"] >= 1


@pytest.mark.integration
def test_tiny_on_a_tensor_parallel_mesh(tiny_target, cli_env):
    """--mesh model=2 on two host devices: target and self-draft cut over `model`, the same tokens as plain
    decoding on one device."""
    common = ["--target", tiny_target, "--draft-layers", "1", "--max-new-tokens", "8", "--json", "--prompt", "tree"]
    ar = _json(_cli(cli_env, *common, "--policy", "ar"))
    two = {**cli_env, "XLA_FLAGS": cli_env["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2"}
    proc = _cli(two, *common, "--mesh", "model=2", "--budget", "static")
    out = _json(proc)
    assert out["policy"] == "sage" and out["token_ids"] == ar["token_ids"]
    assert "on the mesh {'data': 1, 'fsdp': 1, 'model': 2}" in proc.stderr


@pytest.mark.integration
def test_exact_mode_on_a_tensor_parallel_mesh(tiny_target, cli_env):
    """--matmul exact --mesh model=2 --dtype bfloat16 (no refusal): SAGE's tokens are the one-device exact AR's."""
    common = ["--target", tiny_target, "--draft-layers", "1", "--max-new-tokens", "8", "--json", "--prompt", "tree",
              "--matmul", "exact", "--dtype", "bfloat16"]
    ar = _json(_cli(cli_env, *common, "--policy", "ar"))
    two = {**cli_env, "XLA_FLAGS": cli_env["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2"}
    proc = _cli(two, *common, "--mesh", "model=2", "--budget", "static")
    out = _json(proc)
    assert out["policy"] == "sage" and out["token_ids"] == ar["token_ids"]
    assert "on the mesh {'data': 1, 'fsdp': 1, 'model': 2}" in proc.stderr


@pytest.fixture(scope="session")
def other_vocab(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("other_vocab"), 200)


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory):
    """Our converted checkpoints of tiny random VLMs (`vlm_checkpoint.save`): a Qwen2.5-VL target and its one-layer
    draft, an image-only LLaVA-OneVision with a 64-token context; an image and a video file."""
    import numpy as np
    from PIL import Image

    from sage_jax.bench.tiny_vlm import tiny_vlm
    from sage_jax.io import vlm_checkpoint

    root = tmp_path_factory.mktemp("vlm_dirs")
    target = tiny_vlm("qwen2_5_vl", 0, root / "p0")
    draft = tiny_vlm("qwen2_5_vl", 1, root / "p1", n_layers=1, like=target, noise=0.05)
    small = tiny_vlm("llava_onevision", 0, root / "p2", video=False, max_position=64)
    short = tiny_vlm("llava_onevision", 0, root / "p3", max_position=64)
    out = {"target": vlm_checkpoint.save(target, root / "qwen2.5-vl-72b"),
           "draft": vlm_checkpoint.save(draft, root / "qwen2.5-vl-7b"),
           "image_only": vlm_checkpoint.save(small, root / "llava-image-only"),
           "short": vlm_checkpoint.save(short, root / "llava-64-tokens"),
           "wide_vocab": vlm_checkpoint.save(_wider_vocab(target, root / "p4"), root / "qwen2.5-vl-wide-vocab"),
           "root": str(root)}
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(root / "cat.png")
    np.save(root / "clip.npy", rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8))
    os.makedirs(root / "no_frames")
    np.save(root / "long_clip.npy", rng.integers(0, 256, (32, 56, 56, 3), dtype=np.uint8))
    return out


def _wider_vocab(like, directory):
    """A one-layer draft VLM of `like`'s family whose LM has 64 more vocabulary rows than `like`'s."""
    import dataclasses

    from flax import nnx

    from sage_jax.bench.tiny_vlm import tiny_vlm
    from sage_jax.io.vision_lm import VisionLM
    from sage_jax.models.qwen25_vl import Qwen25VL

    small = tiny_vlm("qwen2_5_vl", 1, directory, n_layers=1, like=like)
    cfg = small.config.replace(text=dataclasses.replace(small.config.text,
                                                        vocab_size=small.config.text.vocab_size + 64))
    return VisionLM(Qwen25VL(cfg, rngs=nnx.Rngs(1)), small.tokenizer, processor_dir=str(directory),
                    source="tiny qwen2_5_vl, wider vocabulary")


BAD = {
    "missing_target": (["--target", "/nonexistent/model.gguf"], "no such file"),
    "missing_draft": (["--target", "{tiny}", "--draft", "/nonexistent/draft"], "no such file"),
    "image_missing": (["--image", "/nonexistent/cat.png"], "no such image file"),
    "image_unreadable": (["--image", "{tiny}/config.json"], "not an image file"),
    "video_unreadable": (["--video", "{tiny}/config.json"], "not a video"),
    "image_text_target": (["--target", "{tiny}", "--image", "{png}"], "need a vision-language target"),
    "draft_vocab": (["--target", "{tiny}", "--draft", "{other}"], "vocabulary"),
    "draft_layers": (["--target", "{tiny}", "--draft-layers", "5"], "layers"),
    "draft_and_layers": (["--target", "{tiny}", "--draft", "{other}", "--draft-layers", "1"], "not both"),
    "prompt_too_long": (["--target", "{tiny}", "--draft-layers", "1", "--prompt", "tokens " * 400], "context"),
    "max_new_tokens": (["--max-new-tokens", "0"], "max-new-tokens"),
    "unknown_policy": (["--policy", "beam"], "invalid choice"),
    "negative_temperature": (["--temperature", "-0.5"], "temperature"),
    "top_p_zero": (["--top-p", "0"], "top-p"),
    "top_p_big": (["--top-p", "1.5"], "top-p"),
    "top_k_negative": (["--top-k", "-1"], "top-k"),
    "pallas_head_dim": (["--target", "{tiny}", "--draft-layers", "1", "--attention", "pallas"], "head dims"),
    "unknown_attention": (["--attention", "flash"], "invalid choice"),
    "unknown_flag": (["--beam-width", "4"], "unrecognized"),
    "prune_ratio": (["--prune-ratio", "0.8,2"], "--prune-ratio"),
    "retrieval_too_long": (["--retrieval", "99"], "--retrieval"),
    "datastore_ar": (["--datastore", "--policy", "ar"], "--datastore needs a tree policy"),
    "datastore_missing": (["--target", "{tiny}", "--draft-layers", "1", "--datastore"], "has no datastore"),
    "video_image_only": (["--target", "{image_only}", "--video", "{root}/clip.npy"], "images only"),
    "visual_tokens_too_many": (["--target", "{image_only}", "--image", "{root}/cat.png", "--max-new-tokens", "4"],
                               "visual tokens"),
    "vlm_text_draft": (["--target", "{vlm}", "--draft", "{tiny}", "--image", "{root}/cat.png"], "draft"),
    "vlm_draft_family": (["--target", "{vlm}", "--draft", "{image_only}", "--image", "{root}/cat.png"],
                         "must be of the target's family"),
    "vlm_draft_vocab": (["--target", "{vlm}", "--draft", "{root}/qwen2.5-vl-wide-vocab", "--image",
                         "{root}/cat.png"], "vocabulary"),
    "video_too_many_frames": (["--target", "{root}/llava-64-tokens", "--video", "{root}/long_clip.npy",
                               "--max-new-tokens", "4"], "visual tokens"),
    "video_empty_folder": (["--video", "{root}/no_frames"], "holds no frame images"),
    "bad_int": (["--max-new-tokens", "many"], "expected an integer"),
    "mesh_axis": (["--mesh", "data=1,tensor=2"], "unknown mesh axis 'tensor'"),
    "mesh_size": (["--mesh", "model=0"], "positive integer"),
    "mesh_syntax": (["--mesh", "model"], "AXIS=SIZE"),
    "mesh_devices": (["--target", "{tiny}", "--draft-layers", "1", "--mesh", "model=3"], "do not split"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(case, tiny_target, other_vocab, cli_env, vlm_dirs):
    args, needle = BAD[case]
    png = os.path.join(os.path.dirname(tiny_target), "cat.png")
    if not os.path.exists(png):
        from PIL import Image

        Image.new("RGB", (32, 24), (200, 30, 30)).save(png)
    args = [a.format(tiny=tiny_target, other=other_vocab, png=png, image_only=vlm_dirs["image_only"],
                     root=vlm_dirs["root"], vlm=vlm_dirs["target"]) for a in args]
    proc = _cli(cli_env, *args, "--json", timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert proc.stdout == ""


#: The cases of BAD refused before any model loads (`parse_args` / `check_args`): cheap in the test process.
EARLY = ["bad_int", "datastore_ar", "draft_and_layers", "image_missing", "image_unreadable", "max_new_tokens",
         "mesh_axis", "mesh_size", "mesh_syntax", "missing_draft", "missing_target", "negative_temperature",
         "prune_ratio", "retrieval_too_long", "top_k_negative", "top_p_big", "top_p_zero", "unknown_attention",
         "unknown_flag", "unknown_policy", "video_unreadable"]


@pytest.mark.parametrize("case", EARLY)
def test_bad_input_in_process_exits_2_with_one_line(case, tmp_path, capsys):
    """`generate.main(argv)`: the same one-line error and exit code 2 as the command (run as a process, with every
    case of BAD, under -m integration). The paths are stand-ins: nothing here reads a model."""
    from sage_jax import generate

    for d in ("tiny", "other"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text("{}")
    args, needle = BAD[case]
    args = [a.format(tiny=tmp_path / "tiny", other=tmp_path / "other") for a in args]
    assert generate.main([*args, "--json"]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert out == ""


def _hostile_files(root):
    """A PNG whose header claims 30,000² pixels, a .npy whose header claims 10 PiB, a 0-frame clip, a folder named
    like an image."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    (root / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0,
                                                                                      0, 0))
                                    + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (100000, 100000, 100000, 3), }"
    header += " " * (63 - (len(header) + 10) % 64) + "\n"
    magic = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header))
    (root / "huge.npy").write_bytes(magic + header.encode() + b"\0" * 16)
    np.save(root / "empty.npy", np.zeros((0, 32, 32, 3), np.uint8))
    (root / "folder.png").mkdir()


@pytest.mark.parametrize("argv,needle", [
    (["--image", "{root}/bomb.png"], "too large an image"),
    (["--video", "{root}/huge.npy"], "not a readable .npy array"),
    (["--video", "{root}/empty.npy"], "holds no frames"),
    (["--image", "{root}/folder.png"], "is a folder"),
    (["--prompt", "caf\udcff"], "not valid UTF-8"),  # the byte 0xff as argv hands it to Python
    (["--prompt", "  \n"], "--prompt is empty"),
])
def test_hostile_inputs_are_one_line_before_any_model_loads(argv, needle, tmp_path, capsys):
    from sage_jax import generate

    _hostile_files(tmp_path)
    assert generate.main([a.format(root=tmp_path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert out == ""


@pytest.mark.integration
def test_readme_main_command(cli_env, cache_dir):
    """The README's main command on the shipped SmolLM2 target with its shipped draft head, compared with AR in the
    same process (a shorter answer than the default 128 tokens)."""
    from sage_jax.io.loader import default_draft

    env = dict(cli_env, SAGE_JAX_CACHE=cache_dir)  # the session's conversion cache, not the user's
    proc = _cli(env, "--max-new-tokens", "24", "--compare", "--json", timeout=900)
    out = _json(proc)
    assert out["policy"] == "sage" and "decoding" in out["text"].lower()
    assert len(out["token_ids"]) == 24 and out["compare"]["identical"]
    if default_draft() is not None:
        assert "shipped EAGLE head" in proc.stderr
        # --budget auto: trees where they are predicted to pay, else plain decoding (this 2-core CPU).
        if out["stats"]["budget"] == [0, 0]:
            assert "decoded plainly" in proc.stderr and out["stats"]["mean_accepted"] == 0
        else:
            assert out["stats"]["mean_accepted"] > 0.3


@pytest.mark.integration
def test_readme_vlm_command_and_python(vlm_dirs, cli_env, monkeypatch):
    """docs/vlm.md's command and Python snippet, run as written on converted tiny Qwen2.5-VL checkpoints named as
    there: SAGE with the pruned draft equals plain decoding (the command's --compare, and AR in Python)."""
    root = vlm_dirs["root"]
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "vlm.md")).read()
    cmd = next(b for b in readme.split("```bash")[1:] if "--image cat.png" in b).split("```")[0]
    line = cmd.replace("\\\n", " ").splitlines()[-1].split()
    assert line[:3] == [".venv/bin/python", "-m", "sage_jax.generate"]
    args = [a for a in line[3:] if not a.startswith("[")]
    args = args[: args.index("--prompt")] + ["--prompt", "What is in this picture?"]
    args = [os.path.join(root, a) if a in ("qwen2.5-vl-72b", "qwen2.5-vl-7b", "cat.png") else a for a in args]
    proc = _cli(cli_env, *args, "--compare", "--budget", "static", "--max-new-tokens", "12", "--json", timeout=600)
    out = _json(proc)
    assert out["policy"] == "sage" and out["compare"]["identical"]
    st = out["stats"]
    assert st["draft_prompt_tokens"] < st["prompt_tokens"] and st["draft_forwards"] > st["steps"]
    code = next(b for b in readme.split("```python")[1:] if "load_engine(\"qwen2.5-vl-72b\"" in b).split("```")[0]
    monkeypatch.chdir(root)
    import sage_jax

    scope = {"sage_jax": sage_jax}
    exec(code.replace("max_new_tokens=64", "max_new_tokens=12"), scope)  # noqa: S102 (our own docs)
    gen = scope["gen"]
    ar = scope["engine"].generate(["What is in this picture?"], images=[["cat.png"]], policy="ar", max_new_tokens=12)
    assert gen.token_ids == ar.token_ids and gen.policy == "sage"
    assert gen.stats.draft_prompt_tokens < gen.stats.prompt_tokens


@pytest.mark.integration
def test_generate_image_on_the_shipped_vlm(cli_env, cache_dir, tmp_path):
    """`generate --image <held-out Fashion-MNIST test image>` with nothing else given: the shipped home-trained VLM
    and the shipped head answer the default image question, name the right class, and SAGE equals AR (more
    images in `tests/sage_jax/test_api.py`, all 100 with `python -m sage_jax.bench --vlm --prompts 100`)."""
    from PIL import Image

    from configs.datasets import FASHION_MNIST_DIR
    from sage_jax.training import vlm_data

    if not os.path.isdir(FASHION_MNIST_DIR):
        pytest.skip("dataset-fashion-mnist missing")
    test = vlm_data.fashion("test")
    i = int(vlm_data.heldout_indices(1)[0])
    path = tmp_path / f"heldout_{i}.png"
    Image.fromarray(test.pixels[i]).save(path)
    proc = _cli(dict(cli_env, SAGE_JAX_CACHE=cache_dir), "--image", str(path), "--budget", "static",
                "--max-new-tokens", "16", "--compare", "--json", timeout=900)
    out = _json(proc)
    assert "home-trained vision tower" in proc.stderr and "shipped draft VLM" in proc.stderr
    assert out["compare"]["identical"], (out["text"], out["compare"])
    assert vlm_data.class_named(out["text"]) == int(test.labels[i]), out["text"]
    assert out["stats"]["draft_prompt_tokens"] < out["stats"]["prompt_tokens"]  # the draft saw a pruned image


@pytest.mark.integration
def test_generate_video_on_the_shipped_vlm(cli_env, cache_dir, tmp_path):
    """The README's clip: `write_clip` makes held-out clip 0 as an animated GIF, and `generate --video` with nothing
    else given asks the shipped VLM which items appear: its answer names them, SAGE equals AR, and the draft VLM saw
    a pruned clip (a tenth of its video tokens)."""
    from configs.datasets import FASHION_MNIST_DIR
    from sage_jax.training import vlm_data

    if not os.path.isdir(FASHION_MNIST_DIR):
        pytest.skip("dataset-fashion-mnist missing")
    path = str(tmp_path / "clip.gif")
    items = vlm_data.write_clip(path, 0)
    proc = _cli(dict(cli_env, SAGE_JAX_CACHE=cache_dir), "--video", path, "--budget", "static",
                "--max-new-tokens", "16", "--compare", "--json", timeout=900)
    out = _json(proc)
    assert "shipped draft VLM" in proc.stderr
    assert out["compare"]["identical"], (out["text"], out["compare"])
    assert vlm_data.classes_named(out["text"]) == {vlm_data.FASHION.index(k) for k in items}, out["text"]
    assert out["stats"]["draft_prompt_tokens"] < out["stats"]["prompt_tokens"]
