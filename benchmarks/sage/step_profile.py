"""Where a decoding step's time goes on the real target: model forwards vs the loop's own work, from an XLA profile.

    python benchmarks/sage/step_profile.py [--policies ar,chain,static,eagle2,sage] [--new-tokens 64]
        [--prompts 3] [--top 8] [--budget static|NODES,DEPTH] [--out step_profile.md]

Decodes held-out prompts with the default target and shipped draft (greedy, one fixed budget) under
`jax.profiler`, then splits the self-time of every executed XLA op by the name scope it was traced under:

* **model**: ops under `sage_jax.models.serving_lm.MODEL_SCOPE` (the target's and the draft's forwards and LM heads);
* **step work**: every other op of the step (log-softmax and top-k of the draft, tree building, verification,
  KV compaction, the policy's state);
* **control**: the self-time of while/conditional thunks and of XLA's thunk executor (dispatch);
* **unattributed**: ops XLA left without a name (mostly copies it inserted), unless every user of one is model
  work (a KV cache transposed for an attention dot), which makes it model work too.

The aim is step work + control ≤ 10% of the step. Needs a quiet machine: it times real steps.
"""

from __future__ import annotations

import os
import sys
import tempfile

_DUMP = ""
if __name__ == "__main__":  # the op -> name-scope map comes from the optimised HLO, dumped as modules compile
    _DUMP = tempfile.mkdtemp(prefix="step_profile_hlo_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402

from sage_jax.models.serving_lm import MODEL_SCOPE  # noqa: E402

_CONTROL = ("while", "cond", "conditional", "call", "ThunkExecutor")


def op_names(files: list[str]) -> dict[tuple[str, str], str]:
    """(module name, instruction) -> op_name metadata, from optimised-HLO dumps; dots and fusions that contain one
    map to "dot" (XLA:CPU drops the metadata of the dots it rewrites, and fuses the LM head's matmul with the
    log-softmax after it, whose name the fusion then carries; the matmul dominates such a fusion)."""
    out = {}
    for f in files:
        module = os.path.basename(f).split(".")[1]
        with_dot, calls, computation, users = set(), {}, None, collections.defaultdict(set)
        with open(f) as fh:
            for line in fh:
                head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
                if head and not line.startswith(" "):
                    computation = head.group(1)
                    continue
                m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
                if not m:
                    continue
                if " dot(" in line and computation:
                    with_dot.add(computation)
                called = re.search(r"calls=%?([\w.\-]+)", line)
                if called:
                    calls[m.group(1)] = called.group(1)
                operands = re.sub(r"(calls|to_apply|body|condition|branch_computations)=\S+", "",
                                  line.split(" = ", 1)[1])
                for operand in re.findall(r"%([\w.\-]+)", operands):
                    users[operand].add(m.group(1))
                meta = re.search(r'op_name="([^"]*)"', line)
                if " dot(" in line:
                    out[(module, m.group(1))] = "dot"
                elif meta:
                    out[(module, m.group(1))] = meta.group(1)
        for instr, comp in calls.items():
            if comp in with_dot and not instr.startswith(_CONTROL):
                out[(module, instr)] = "dot"
        # XLA drops the metadata of the layout copies it inserts (e.g. a transposed KV cache for an attention
        # dot). An op without a name whose every user is model work is model work too.
        for _ in range(3):  # chains of copies
            for instr, us in users.items():
                key = (module, instr)
                if key not in out and us and all(_is_model(out.get((module, u))) for u in us):
                    out[key] = "dot"
    return out


def _is_model(name: str | None) -> bool:
    return name is not None and (name == "dot" or f"/{MODEL_SCOPE}/" in f"/{name}/")


def self_times(trace_dir: str) -> list[tuple[str, str, float]]:
    """(module, op, exclusive µs) of the compiled ops and thunk-executor runs of the newest trace under
    `trace_dir` (other events, e.g. thread-pool waits inside an op, count towards the op around them)."""
    f = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    events = [e for e in json.load(gzip.open(f))["traceEvents"] if e.get("ph") == "X" and (
        "hlo_module" in e.get("args", {}) or e["name"] == "ThunkExecutor::Execute")]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    out = []
    for es in by_thread.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []
        for e in es:
            while stack and stack[-1][1] <= e["ts"]:
                out.append(tuple(stack.pop()[2:]))
            if stack:
                stack[-1][4] -= e["dur"]
            args = e.get("args", {})
            stack.append([e["ts"], e["ts"] + e["dur"], args.get("hlo_module", ""), args.get("hlo_op", e["name"]),
                          float(e["dur"])])
        out.extend(tuple(s[2:]) for s in stack)
    return out


def classify(module: str, op: str, names: dict) -> str:
    if op.startswith(_CONTROL):
        return "control"
    name = names.get((module, op))
    if name is None:
        return "other"
    # The decoding loop itself multiplies no matrices: a dot is a model's.
    return "model" if _is_model(name) else "step work"


def profile_policy(engine, prompts, policy, new_tokens: int, top: int, budget=None) -> dict:
    before = set(glob.glob(os.path.join(_DUMP, "*after_optimizations.txt")))
    kw = {} if policy == "ar" else {"budget": budget}
    engine.generate(prompts[:1], policy=policy, max_new_tokens=new_tokens, **kw)  # compile (dumps the HLO)
    names = op_names(sorted(set(glob.glob(os.path.join(_DUMP, "*after_optimizations.txt"))) - before)
                     or sorted(before))
    trace_dir = tempfile.mkdtemp(prefix="step_profile_trace_")
    steps = 0
    jax.profiler.start_trace(trace_dir)
    for p in prompts:
        steps += engine.generate([p], policy=policy, max_new_tokens=new_tokens, **kw).stats.steps
    jax.profiler.stop_trace()
    shares: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    for module, op, us in self_times(trace_dir):
        kind = classify(module, op, names)
        shares[kind] += us
        if kind in ("step work", "other"):
            ops[names.get((module, op), f"unattributed {op}")] += us
    total = sum(shares.values())
    return {"steps": steps, "ms_per_step": total / 1e3 / max(steps, 1),
            "share": {k: v / total for k, v in shares.items()},
            "top_step_work": [(n, us / 1e3 / max(steps, 1)) for n, us in ops.most_common(top)]}


def _short(op_name: str) -> str:
    parts = [p for p in op_name.split("/") if not p.startswith(("jit(", "while", "body", "cond", "branch"))]
    return "/".join(parts[-3:])


def report(rows: dict) -> str:
    lines = ["| policy | ms/step (profiled) | model forwards | step work | control | unattributed "
             "| outside the model |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        s = r["share"]
        out = s.get("step work", 0) + s.get("control", 0) + s.get("other", 0)
        lines.append(f"| {name} | {r['ms_per_step']:.1f} | {s.get('model', 0):.1%} | {s.get('step work', 0):.1%} "
                     f"| {s.get('control', 0):.1%} | {s.get('other', 0):.1%} | {out:.1%} |")
    for name, r in rows.items():
        if r["top_step_work"]:
            lines += ["", f"{name}: largest step-work ops (ms/step): "
                      + "; ".join(f"`{_short(n)}` {ms:.2f}" for n, ms in r["top_step_work"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="ar,chain,static,eagle2,sage")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--budget", default="static", help="the trees' budget: static (each policy's full sizes) or "
                    "NODES,DEPTH")
    ap.add_argument("--out", help="also write the Markdown report here")
    args = ap.parse_args(argv)
    from sage_jax.decoding.budget import parse
    budget = parse(args.budget)
    if budget == "auto":
        ap.error("--budget: static or NODES,DEPTH (a profile times one fixed budget)")
    import sage_jax
    from sage_jax.prompts import EVAL_PROMPTS

    # Before anything compiles: a persistent-cache hit would skip the HLO dump (or hand back stale op names).
    jax.config.update("jax_enable_compilation_cache", False)
    engine = sage_jax.load_engine()  # the default target and its shipped head
    prompts = [engine.encode(text) for _, text in EVAL_PROMPTS[: args.prompts]]
    rows = {}
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        policy = "ar" if name == "ar" else sage_jax.TreePolicy.named(name)
        rows[name] = profile_policy(engine, prompts, policy, args.new_tokens, args.top, budget)
        print(f"{name}: {rows[name]['ms_per_step']:.1f} ms/step", file=sys.stderr)
    text = (f"Step profile: default target + shipped draft, greedy, {args.new_tokens} new tokens, "
            f"{len(prompts)} prompts, budget {args.budget}; jax {jax.__version__} on {jax.devices()[0].platform}.\n\n"
            + report(rows))
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
