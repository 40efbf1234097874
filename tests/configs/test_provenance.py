"""What a results file records about what produced it (`configs.provenance`); the benchmarks' own results files are
checked in tests/sage_jax/bench/test_bench.py and tests/pgla_jax/test_cli.py."""

import hashlib
import os

from configs import provenance


def test_a_checkpoint_digest_is_its_manifests(tmp_path):
    """A directory's digest is its SHA256SUMS manifest's sha256 where it has one, else that of the manifest it would
    have; it changes with any file; the shipped head's is its manifest's."""
    from sage_jax.io import loader

    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "a").write_bytes(b"weights")
    (tmp_path / "metadata.json").write_text("{}")
    before = provenance.checkpoint_sha256(tmp_path)
    manifest = loader.write_manifest(tmp_path)
    with open(manifest, "rb") as f:
        assert provenance.checkpoint_sha256(tmp_path) == before == hashlib.sha256(f.read()).hexdigest()
    os.remove(manifest)
    (tmp_path / "params" / "a").write_bytes(b"other weights")
    assert provenance.checkpoint_sha256(tmp_path) != before
    assert provenance.checkpoint_sha256(tmp_path / "metadata.json") == hashlib.sha256(b"{}").hexdigest()
    assert provenance.checkpoint_sha256(None) is None
    shipped = os.path.join(loader.DEFAULT_DRAFT, loader.MANIFEST)
    if os.path.isfile(shipped):
        with open(shipped, "rb") as f:
            assert provenance.checkpoint_sha256(loader.DEFAULT_DRAFT) == hashlib.sha256(f.read()).hexdigest()


def test_record_names_commit_command_checkpoint_and_machine(tmp_path):
    (tmp_path / "ckpt").write_bytes(b"x")
    rec = provenance.record("python -m tool", ["--out", "a b"], {"draft": tmp_path / "ckpt", "lm": None})
    assert rec["command"] == "python -m tool --out 'a b'"
    assert rec["commit"] == "unknown" or len(rec["commit"].removesuffix("-dirty")) == 40
    assert rec["draft"] == str(tmp_path / "ckpt") and rec["draft_sha256"] == hashlib.sha256(b"x").hexdigest()
    assert rec["lm"] is None and rec["lm_sha256"] is None
    assert rec["cpu"] and 1 <= rec["threads"] <= rec["cores"]
    assert rec["jax"] and rec["jaxlib"] and rec["backend"] == "cpu"
    assert provenance.commit(str(tmp_path)) == "unknown"  # not a git checkout
    md = provenance.markdown(rec)
    assert md.splitlines()[0] == "- command: `python -m tool --out 'a b'`" and f"`{rec['commit']}`" in md
