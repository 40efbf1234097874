"""The benchmarked decoders, all on the same weights: ours (AR and every tree policy, SAGE ablations); transformers'
PyTorch baselines (plain greedy `generate` with its dynamic cache, with a static cache, and with a static cache under
`torch.compile`; prompt-lookup decoding; assisted generation with our LM draft exported to HF); and llama.cpp
(`llama-cpp-python`) on the target's own GGUF file, plain and with its prompt-lookup decoding. Each method maps one
tokenized prompt to (tokens, seconds, per-prompt statistics). The peers are the `[bench]` and `[llama]` extras; a
missing one is skipped with one line (`peer_missing`)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

from sage_jax.decoding.policies import TreePolicy

# SAGE ablations (sage.md §1.5): one dimension adapted, no history rule, the α source variants, θ_l on the path's
# cumulative probability (the paper's formal statement) instead of the candidate's own.
SAGE_ABLATIONS: dict[str, dict[str, Any]] = {
    "sage-depth-only": dict(adapt_width=False),
    "sage-width-only": dict(adapt_depth=False),
    "sage-no-history": dict(history=False),
    "sage-fresh-root": dict(alpha_source="fresh_root"),
    "sage-path-mean": dict(alpha_source="accepted_path_mean"),
    "sage-cumulative-theta": dict(threshold_prob="cumulative"),
}
HF_METHODS = ("hf-ar", "hf-ar-static", "hf-ar-compiled", "hf-pld", "hf-assisted")
LLAMA_METHODS = ("llama-cpp", "llama-cpp-pld")
#: How the `[bench]` extra's llama.cpp is installed: built from source for a portable CPU (a native build dies with
#: an illegal instruction on virtual CPUs that hide some of their host's instructions).
LLAMA_INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install -e ".[bench,llama]"'


@dataclasses.dataclass(frozen=True)
class Method:
    """name; kind "ours" or "hf"; policy ("ar" or a TreePolicy) and draft ("main" or "lm") for ours; budget:
    "auto", None (static sizes) or fixed (nodes, depth)."""

    name: str
    kind: str
    policy: Any = None
    draft: str = "main"
    budget: Any = "auto"


def ours_methods(budget, ablations: bool = True, sweep: tuple[int, ...] = (), datastore: bool = False
                 ) -> list[Method]:
    """Our rows; `datastore`: the main engine has a datastore of the target's answers (`sage-datastore`)."""
    static = TreePolicy.static()
    out = [Method("ar", "ours", "ar", budget=None),
           # our AR with XLA's dot for every matmul (`LMConfig.matmul="xla"`): what the skinny CPU kernel adds
           Method("ar-xla", "ours", "ar", draft="xla", budget=None),
           Method("chain-lm", "ours", TreePolicy.chain(), draft="lm", budget=None),
           Method("chain", "ours", TreePolicy.chain(), budget=budget),
           Method("static", "ours", static, budget=None),
           Method("eagle2", "ours", TreePolicy.eagle2(), budget=budget),
           Method("sage", "ours", TreePolicy.sage(), budget=budget),
           # SAGE with a 7-token prompt-lookup chain merged into its trees (decoding/retrieval.py); where no tree
           # pays, --budget auto verifies the chain alone (root + 7 tokens: the 8-row verify bucket)
           Method("sage-retrieval", "ours", TreePolicy.sage(retrieval=7), budget=budget),
           # the chain alone at every step (node budget 0: no draft node, no draft forward), gated by its running
           # precision (`TreePolicy.chains_gate`; a closed gate verifies the root alone): prompt-lookup decoding
           # inside our loop
           Method("chains-only", "ours", TreePolicy.sage(retrieval=7), budget=(0, TreePolicy.sage().d_cap)),
           # ... and a second chain from the datastore of the target's own answers (decoding/datastore.py)
           *([Method("sage-datastore", "ours", TreePolicy.sage(retrieval=8, datastore=True), budget=budget),
              Method("eagle2-datastore", "ours", TreePolicy.eagle2(retrieval=6, datastore=True), budget=budget)]
             if datastore else []),
           # the same node budget as the static tree: the like-for-like τ comparison
           Method(f"sage@{static.n_max}", "ours", TreePolicy.sage(n_max=static.n_max), budget=None)]
    if ablations:
        # At the static tree's node budget too, like sage@N: under --budget auto a CPU chooser may decode plainly,
        # and every ablation would then be the same AR run, saying nothing about what it ablates.
        out += [Method(f"{n}@{static.n_max}", "ours", TreePolicy.sage(n_max=static.n_max, **kw), budget=None)
                for n, kw in SAGE_ABLATIONS.items()]
    out += [Method(f"sage-fixed-{n}", "ours", TreePolicy.sage(), budget=(n, TreePolicy.sage().d_cap))
            for n in sweep]
    return out


def hf_methods() -> list[Method]:
    return [Method(n, "hf") for n in HF_METHODS]


def llama_methods() -> list[Method]:
    return [Method(n, "llama") for n in LLAMA_METHODS]


def peer_missing(kind: str, target: str | None) -> str | None:
    """Why a peer cannot run here (one line), or None: its package is not installed, or (llama.cpp) the target is
    not a GGUF file it can read."""
    import importlib.util

    if kind == "hf" and importlib.util.find_spec("torch") is None:
        return "transformers baselines skipped: torch is not installed (pip install -e \".[bench]\")"
    if kind == "llama":
        if importlib.util.find_spec("llama_cpp") is None:
            return f"llama.cpp skipped: llama-cpp-python is not installed ({LLAMA_INSTALL})"
        if target is None or not str(target).endswith(".gguf"):
            return "llama.cpp skipped: it reads GGUF files and the target is not one"
    return None


class OursRunner:
    """Our engines: one for the main draft (EAGLE head, LM checkpoint or self-draft), one for the LM draft, and
    optionally one whose layers use XLA's dot throughout ("xla", for the `ar-xla` row)."""

    def __init__(self, engine, lm_engine, max_new_tokens: int, xla_engine=None):
        self.engines = {"main": engine, "lm": lm_engine, "xla": xla_engine}
        self.n = max_new_tokens

    def warm_up(self, m: Method, prompt: list[int]) -> float:
        """Compiles (and measures the cost profile for --budget auto): seconds spent."""
        e = self.engines[m.draft]
        t0 = time.perf_counter()
        if m.budget == "auto":  # cost profile, then the full-budget exploring request (its statistics count)
            e.chooser(m.policy, len(prompt), self.n)
            e.generate([prompt], policy="ar", max_new_tokens=self.n)
        e.generate([prompt], policy=m.policy, max_new_tokens=self.n, budget=m.budget)
        return time.perf_counter() - t0

    def run(self, m: Method, prompt: list[int]) -> dict:
        g = self.engines[m.draft].generate([prompt], policy=m.policy, max_new_tokens=self.n, budget=m.budget)
        s = g.stats
        loop = max(s.new_tokens - 1, 1)
        per_step = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
        return {"tokens": g.token_ids[0], "seconds": s.prefill_seconds + s.decode_seconds, "steps": s.steps,
                "tau": s.mean_accepted, "target_forwards": s.target_forwards, "draft_forwards": s.draft_forwards,
                "loop_tokens": loop, "nodes": per_step(s.nodes_trace), "depth": per_step(s.depth_trace),
                "width": per_step(s.width_trace), "alpha_trace": s.alpha_trace, "tau_trace": s.tau_trace,
                "budget": s.budget}


class HFRunner:
    """transformers' eager PyTorch generate on our weights written as HF directories (no download)."""

    def __init__(self, target_dir: str, draft_dir: str, cfg, max_new_tokens: int, threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads or os.cpu_count() or 1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        self.draft.generation_config.num_assistant_tokens = 5  # our chain depth
        self.calls = {"target": 0, "draft": 0}
        self.model.register_forward_pre_hook(lambda *_: self._count("target"))
        self.draft.register_forward_pre_hook(lambda *_: self._count("draft"))
        self.kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(cfg.eos_token_ids) or None,
                       pad_token_id=cfg.pad_token_id)

    def _count(self, which):
        self.calls[which] += 1

    def _extra(self, name: str) -> dict:
        if name == "hf-pld":
            return {"prompt_lookup_num_tokens": 10}
        if name == "hf-assisted":
            return {"assistant_model": self.draft}
        if name == "hf-ar-static":  # preallocated cache, fixed shapes (what torch.compile needs)
            return {"cache_implementation": "static", "disable_compile": True}
        if name == "hf-ar-compiled":  # the same under torch.compile, which transformers only turns on by itself
            from transformers import CompileConfig  # on accelerators

            config = CompileConfig()
            config._compile_all_devices = True  # a class attribute, not an argument
            return {"cache_implementation": "static", "compile_config": config}
        return {}

    def warm_up(self, m: Method, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.run(m, prompt)
        return time.perf_counter() - t0

    def run(self, m: Method, prompt: list[int]) -> dict:
        torch = self.torch
        self.calls = {"target": 0, "draft": 0}
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model.generate(torch.tensor([prompt]), **self.kw, **self._extra(m.name))
            secs = time.perf_counter() - t0
        toks = out[0, len(prompt):].tolist()
        steps = max(self.calls["target"] - 1, 1)  # minus the prefill
        loop = max(len(toks) - 1, 1)
        return {"tokens": toks, "seconds": secs, "steps": steps, "tau": loop / steps - 1.0,
                "target_forwards": self.calls["target"], "draft_forwards": self.calls["draft"], "loop_tokens": loop,
                "nodes": None, "depth": None, "width": None, "alpha_trace": [], "tau_trace": [], "budget": None}


class LlamaCppRunner:
    """llama.cpp through `llama-cpp-python` on the target's GGUF file (its own quantized kernels: the file's Q4_1
    weights are read as stored, where ours are dequantized), greedy, `threads` threads; `llama-cpp-pld` with its
    prompt-lookup draft (10 tokens, as `hf-pld`). Each run starts from an empty cache (no prompt reuse between runs,
    as for ours), and counts the model's evaluations for τ."""

    def __init__(self, gguf: str, eos_ids, max_new_tokens: int, threads: int | None = None, n_ctx: int = 4096):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw = dict(model_path=str(gguf), n_threads=threads or os.cpu_count() or 1, n_ctx=n_ctx, verbose=False)
        self.llms = {"llama-cpp": Llama(**kw),
                     "llama-cpp-pld": Llama(**kw, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}
        self.evals = 0
        for llm in self.llms.values():
            llm.eval = self._counted(llm.eval)
        self.eos, self.n = set(eos_ids), max_new_tokens

    def _counted(self, fn):
        def wrapped(tokens):
            self.evals += 1
            return fn(tokens)
        return wrapped

    def warm_up(self, m: Method, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.run(m, prompt)
        return time.perf_counter() - t0

    def run(self, m: Method, prompt: list[int]) -> dict:
        llm = self.llms[m.name]
        llm.reset()  # forget the last run's prompt: no prefix reuse between runs
        self.evals, toks = 0, []
        t0 = time.perf_counter()
        for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            toks.append(int(t))
            if t in self.eos or len(toks) >= self.n:
                break
        secs = time.perf_counter() - t0
        loop = max(len(toks) - 1, 1)
        steps = max(self.evals - 1, 1)  # minus the prefill
        return {"tokens": toks, "seconds": secs, "steps": steps, "tau": loop / steps - 1.0,
                "target_forwards": self.evals, "draft_forwards": 0, "loop_tokens": loop, "nodes": None,
                "depth": None, "width": None, "alpha_trace": [], "tau_trace": [], "budget": None}


def export_hf(cfg, params, tok, n_layers: int | None = None, root: str | None = None) -> str:
    """Our canonical params (optionally truncated to the first `n_layers` + final norm + head: the self-draft)
    written as an HF directory under `root` (a temporary directory by default)."""
    from sage_jax.io.hf import write_hf

    if n_layers is not None:
        params = dict(params, blocks={k: v[:n_layers] for k, v in params["blocks"].items()})
        cfg = cfg.replace(n_layers=n_layers)
    root = root or tempfile.mkdtemp(prefix="sage_bench_hf_")
    return write_hf(os.path.join(root, f"lm{n_layers or cfg.n_layers}"), cfg, params, tok)

