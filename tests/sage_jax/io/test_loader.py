"""The shipped draft is checked against its SHA256SUMS before it is used; a changed, missing or extra file is one
clear error."""

import os
import shutil

import pytest

from sage_jax.io import loader


def test_shipped_draft_matches_its_manifest():
    if loader.default_draft() is None:  # verifies the manifest on the way
        pytest.skip("no shipped draft in this checkout")


def test_manifest_catches_a_changed_missing_or_extra_file(tmp_path, cache_dir):
    src = tmp_path / "head"
    shutil.copytree(loader.DEFAULT_DRAFT, src)
    os.remove(src / loader.MANIFEST)
    with pytest.raises(ValueError, match="has no SHA256SUMS"):
        loader.verify_manifest(src)
    loader.write_manifest(src)
    loader.verify_manifest(src)
    (src / "acceptance.json").write_text("{}")  # the rewritable prior is not checked
    (src / "params" / "acceptance.json").write_text("{}")  # nor a nested one (the VLM asset's draft/ has one)
    loader.verify_manifest(src)
    os.remove(src / "params" / "acceptance.json")
    meta = src / "metadata.json"
    meta.write_text(meta.read_text().replace("eagle_head", "eagle_head "))
    with pytest.raises(ValueError, match="metadata.json does not match its sha256"):
        loader.verify_manifest(src)
    loader.write_manifest(src)
    (src / "params" / "stray").write_text("x")
    with pytest.raises(ValueError, match=r"unlisted \['params/stray'\]"):
        loader.verify_manifest(src)
    os.remove(src / "params" / "stray")
    os.remove(src / "params" / "_METADATA")
    with pytest.raises(ValueError, match=r"missing \['params/_METADATA'\]"):
        loader.verify_manifest(src)


def test_shipped_drafts_carry_a_prior_the_chooser_uses():
    """The shipped drafts (the text head, the VLM's draft VLM and its head) carry `acceptance.json` for every tree
    policy, at the policies' current static sizes: a prior of other sizes is silently ignored, and `--budget auto`
    would then explore its first request with full trees (the VLM's once ran at 0.44x AR that way on a 2-core CPU)."""
    from sage_jax.decoding.policies import TreePolicy
    from sage_jax.io import lm_checkpoint

    for path in (loader.default_draft(), loader.default_vlm_draft(), loader.vlm_head_draft()):
        policies = lm_checkpoint.read_acceptance(path)["policies"]
        assert {"sage", "eagle2", "static", "chain"} <= policies.keys(), path
        for name, prior in policies.items():
            pol = TreePolicy.named(name)
            assert (prior["n_max"], prior["d_cap"]) == (pol.n_max, pol.d_cap), (path, name)
            assert sum(prior["offered"]) > 0 and 0 < sum(prior["accepted"]) <= sum(prior["offered"]), (path, name)
