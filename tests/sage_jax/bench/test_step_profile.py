"""The step profiler's attribution: model ops carry the model name scope through XLA, the loop's own do not."""

import os

import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax.decoding.tree import causal_visibility
from sage_jax.models import Decoder, LMConfig


def test_model_ops_and_loop_ops_are_told_apart(tmp_path, benchmark_script):
    sp = benchmark_script("step_profile")
    model = Decoder(LMConfig.tiny(), rngs=nnx.Rngs(0)).serving()

    def step(tokens):
        slots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _ = model.forward(tokens, slots, causal_visibility(slots, jnp.zeros((1,), jnp.int32), 4))
        # The loop's own work on the model's logits; the salt makes a new module: the persistent cache keys
        # ignore op metadata and would hand back HLO compiled before a change to the name scopes.
        return jax.lax.top_k(model.head(hidden)[:, -1], 3)[1], jnp.int32(salt)

    salt = int.from_bytes(os.urandom(3), "little")
    text = jax.jit(step).lower(jnp.ones((1, 4), jnp.int32)).compile().as_text()
    dump = tmp_path / "module_0001.jit_step.cpu_after_optimizations.txt"
    dump.write_text(text)
    names = sp.op_names([str(dump)])
    kinds = {}
    for (module, op), _ in names.items():
        assert module == "jit_step"
        kinds.setdefault(sp.classify(module, op, names), []).append(op)
    assert kinds.get("model") and kinds.get("step work"), kinds
    # Not only the dots: the norms and the attention softmax are the model's too (the name scope survives XLA).
    assert any(sp.classify(*key, names) == "model" and "/model/" in name for key, name in names.items())
    assert any(names[("jit_step", op)] != "dot" and "top_k" in names[("jit_step", op)] for op in kinds["step work"])
    assert sp.classify("jit_step", "while.3", names) == "control"
    assert sp.classify("jit_step", "no-such-op.1", names) == "other"


def test_unnamed_copies_count_as_model_work_only_when_every_user_is_the_models(tmp_path, benchmark_script):
    sp = benchmark_script("step_profile")
    # A hand-written optimised module: XLA's layout copies carry no op_name metadata.
    text = """HloModule jit_f

ENTRY %main.1 (p0: f32[4,8], p1: f32[8,4]) -> (f32[4,4], f32[8,4]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,4]{1,0} parameter(1)
  %copy.1 = f32[8,4]{0,1} copy(%p1)
  %copy.2 = f32[8,4]{0,1} copy(%copy.1)
  %dot.1 = f32[4,4]{1,0} dot(%p0, %copy.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy.3 = f32[8,4]{1,0} copy(%p1)
  %neg.1 = f32[8,4]{1,0} negate(%copy.3), metadata={op_name="jit(f)/model/neg"}
  %add.1 = f32[8,4]{1,0} add(%copy.3, %neg.1), metadata={op_name="jit(f)/while/body/add"}
  ROOT %tuple.1 = (f32[4,4]{1,0}, f32[8,4]{1,0}) tuple(%dot.1, %add.1)
}
"""
    dump = tmp_path / "module_0001.jit_f.cpu_after_optimizations.txt"
    dump.write_text(text)
    names = sp.op_names([str(dump)])
    assert sp.classify("jit_f", "copy.2", names) == "model"  # feeds the dot
    assert sp.classify("jit_f", "copy.1", names) == "model"  # feeds only copy.2: a chain
    assert sp.classify("jit_f", "copy.3", names) == "other"  # also read by the loop's own add
    assert sp.classify("jit_f", "neg.1", names) == "model"
    assert sp.classify("jit_f", "add.1", names) == "step work"
