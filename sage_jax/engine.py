"""Host-side entry: bucket prompts, compile once per (config, bucket), run, and report statistics.

Everything that runs per token happens inside two compiled calls (prefill, then the decode loop); this module
only pads prompts with numpy, keeps the compiled executables, and times them. Compilations are counted here:
one prefill and one decode loop per (policy, sampling, batch, prompt bucket, new-token bucket).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sage_jax.decoding import autoregressive as ar
from sage_jax.decoding import budget as budget_lib
from sage_jax.decoding import speculative as spec
from sage_jax.decoding import widths
from sage_jax.decoding.drafts import DraftSpec, EagleWeights, build_drafter
from sage_jax.decoding.policies import TreePolicy
from sage_jax.decoding.sampling import SamplingConfig
from sage_jax.models.decoder import Decoder

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Next power of two >= n (and >= minimum): lengths inside one bucket share one compilation."""
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


def run_config(policy: str | TreePolicy, prompt_len: int, max_new_tokens: int, **kw) -> ar.ARConfig:
    """The static config of a run: lengths bucketed; a `SpecConfig` for tree policies. `kw`: sampling, eos_ids,
    pad_id. Its `.capacity` is the cache size the run allocates (checked against the model's context)."""
    p_len, n_out = bucket(prompt_len), bucket(max_new_tokens)
    if policy == "ar":
        return ar.ARConfig(prompt_len=p_len, max_new_tokens=n_out, **kw)
    pol = policy if isinstance(policy, TreePolicy) else TreePolicy.named(policy)
    return spec.SpecConfig(policy=pol, prompt_len=p_len, max_new_tokens=n_out, **kw)


@dataclasses.dataclass
class Stats:
    """Statistics of one `generate` call (see design.md's --json schema)."""

    new_tokens: int
    steps: int
    target_forwards: int
    draft_forwards: int
    mean_accepted: float  # τ: accepted draft tokens per step, bonus token excluded
    mean_tokens_per_step: float  # τ + 1
    tokens_per_second: float  # decode loop only (prefill and compile excluded)
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    compiles: int
    alpha_trace: list[float]
    depth_trace: list[int] = dataclasses.field(default_factory=list)
    nodes_trace: list[int] = dataclasses.field(default_factory=list)
    tau_trace: list[int] = dataclasses.field(default_factory=list)
    width_trace: list[int] = dataclasses.field(default_factory=list)
    draft_width: int = 0  # summed widths of the draft forwards (tokens they ran on, incl. prefill)
    verify_width: int = 0  # summed widths of the target's verify forwards
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # accepted nodes per priority rank
    budget: tuple[int, int] | None = None  # (node budget, depth cap) the run used

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.steps} steps | τ {self.mean_accepted:.2f} "
                f"(τ+1 {self.mean_tokens_per_step:.2f}) | {self.tokens_per_second:.1f} tok/s decode | "
                f"target fwd {self.target_forwards}, draft fwd {self.draft_forwards} | "
                f"prefill {self.prefill_seconds:.2f}s, compile {self.compile_seconds:.1f}s ({self.compiles} compiles)")


@dataclasses.dataclass
class Generation:
    token_ids: list[list[int]]
    policy: str
    stats: Stats


def _prefill_spec(cfg, spec_d, target, draft, tokens, pad, temperature, max_new, key, alpha0, n_budget, d_budget):
    drafter = build_drafter(spec_d, target, draft)
    return spec.spec_prefill(cfg, target, drafter, tokens, pad, temperature, max_new, key, alpha0, n_budget,
                             d_budget)


def _decode_spec(cfg, spec_d, target, draft, state, temperature):
    return spec.spec_decode(cfg, target, build_drafter(spec_d, target, draft), state, temperature)


class Engine:
    """A target LM (+ a draft) ready to generate with any policy.

    Args:
      target: the target `Decoder`.
      draft: a separate draft `Decoder` with the target's vocabulary, an EAGLE-style head (`EagleWeights`, or the
        path of a head checkpoint), or None.
      draft_spec: derived from `draft` by default; `DraftSpec(kind="self", n_layers=k)` for a self-draft (the
        default without a draft: a quarter of the target's layers).
      sampling: static top-k / top-p settings.
    """

    def __init__(self, target: Decoder, draft: Decoder | EagleWeights | str | None = None, *,
                 draft_spec: DraftSpec | None = None,
                 sampling: SamplingConfig | None = None):
        self.target = target
        self.sampling = sampling or SamplingConfig()
        # Serving form once (per-layer fused weights); the decoding loops never see the NNX modules.
        self._lm_t = target.serving()
        if isinstance(draft, str):
            draft = EagleWeights.load(draft, self._lm_t)
        if draft_spec is None:
            kind = "eagle" if isinstance(draft, EagleWeights) else "model"
            draft_spec = DraftSpec(kind=kind) if draft is not None else DraftSpec(
                kind="self", n_layers=max(1, target.cfg.n_layers // 4))
        self.draft_spec = draft_spec
        self._lm_d = draft.serving() if isinstance(draft, Decoder) else draft
        build_drafter(draft_spec, self._lm_t, self._lm_d)  # validates vocab / layer counts now, not inside jit
        self._compiled: dict[tuple, tuple[Any, Any]] = {}
        self._choosers: dict[tuple, budget_lib.BudgetChooser] = {}
        self.compile_seconds = 0.0
        self.profile_seconds = 0.0

    @property
    def compiles(self) -> int:
        """Executables compiled so far (2 per configuration: prefill and decode loop)."""
        return 2 * len(self._compiled)

    def _executables(self, key: tuple, lower) -> tuple[tuple[Any, Any], float]:
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        exe = lower()
        dt = time.perf_counter() - t0
        self._compiled[key] = exe
        self.compile_seconds += dt
        return exe, dt

    def chooser(self, policy: str | TreePolicy, prompt_len: int = 256, max_new_tokens: int = 128
                ) -> budget_lib.BudgetChooser:
        """The budget chooser of a policy (its cost profile measured on this device on first use, or loaded
        from the profile cache), shared by every `generate(budget="auto")` call with that policy."""
        cfg = run_config(policy, prompt_len, max_new_tokens)
        pol = cfg.policy
        key = (pol, self.draft_spec)
        if key not in self._choosers:
            v_sizes = widths.sizes(pol.n_max + 1, 2, cfg.bucket_ratio)
            d_sizes = widths.sizes(pol.frontier, 1, cfg.bucket_ratio)
            desc = f"{self.draft_spec}|{self._lm_d.cfg if self._lm_d is not None else None}"
            pkey = budget_lib.profile_key(self.target.cfg, desc, cfg.capacity, v_sizes, d_sizes)
            t0 = time.perf_counter()
            prof = budget_lib.cached_profile(pkey, lambda: budget_lib.measure_profile(
                self._lm_t, self._lm_d, self.draft_spec, cfg.capacity, v_sizes, d_sizes))
            self.profile_seconds += time.perf_counter() - t0
            self._choosers[key] = budget_lib.BudgetChooser(prof, n_max=pol.n_max, d_cap=pol.d_cap,
                                                           frontier=pol.frontier)
        return self._choosers[key]

    def generate(self, prompts: Sequence[Sequence[int]], *, policy: str | TreePolicy = "sage",
                 max_new_tokens: int = 128, temperature: float | Sequence[float] = 0.0, seed: int = 0,
                 alpha_init: float | None = None, budget: tuple[int, int] | str | None = None) -> Generation:
        """Generates for a batch of tokenized prompts (left-padded internally).

        `policy`: "ar", a policy name or a `TreePolicy`. `alpha_init`: SAGE's confidence for the first tree
        (default: the policy's `alpha_init`). `budget`: (node budget, depth cap) at most the policy's static
        (n_max, d_cap), e.g. from `budget.BudgetChooser`; arrays in the compiled loop, so any value reuses the
        compilation (default: the static sizes); "auto": chosen by `chooser(policy)` from the measured cost
        profile and the acceptance statistics of earlier calls, which this call then extends (plain
        autoregressive decoding, reported as budget (0, 0), when no tree is predicted to pay).
        """
        if isinstance(budget, str):
            if budget != "auto":
                raise ValueError(f"budget must be (nodes, depth), None or 'auto', got {budget!r}")
            if policy == "ar":
                return self.generate(prompts, policy=policy, max_new_tokens=max_new_tokens,
                                     temperature=temperature, seed=seed)
            ch = self.chooser(policy, max(len(p) for p in prompts), max_new_tokens)
            choice = ch.choose()
            if choice is None:  # no tree pays on this device with the acceptance seen so far: plain decoding
                gen = self.generate(prompts, policy="ar", max_new_tokens=max_new_tokens, temperature=temperature,
                                    seed=seed)
                gen.stats.budget = (0, 0)
                return gen
            gen = self.generate(prompts, policy=policy, max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=seed, alpha_init=alpha_init, budget=choice)
            ch.update(gen.stats)
            return gen
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        temps = np.broadcast_to(np.asarray(temperature, np.float32), (len(prompts),)).copy()
        if np.any(temps < 0) or not np.all(np.isfinite(temps)):
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        b = len(prompts)
        cfgt = self.target.cfg
        pad_id = cfgt.pad_token_id
        cfg = run_config(policy, max(len(p) for p in prompts), max_new_tokens, sampling=self.sampling,
                         eos_ids=tuple(cfgt.eos_token_ids), pad_id=pad_id)
        if cfg.capacity > cfgt.max_position:
            raise ValueError(f"prompt + new tokens (+ tree) need {cfg.capacity} cache slots, more than the model's "
                             f"context {cfgt.max_position}")
        p_len = cfg.prompt_len
        tokens = np.full((b, p_len), pad_id, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, p_len - len(p):] = np.asarray(p, np.int32)
        pad = np.asarray([p_len - len(p) for p in prompts], np.int32)
        max_new = np.full((b,), max_new_tokens, np.int32)
        key = jax.random.key(seed)
        name = policy if isinstance(policy, str) else policy.name

        if name == "ar":
            args = (tokens, pad, temps, max_new, key)

            def lower():
                pre = jax.jit(ar.ar_prefill, static_argnums=0).lower(cfg, self._lm_t, *args).compile()
                st = jax.eval_shape(functools.partial(ar.ar_prefill, cfg), self._lm_t, *args)
                dec = jax.jit(ar.ar_decode, static_argnums=0, donate_argnums=2).lower(
                    cfg, self._lm_t, st, temps).compile()
                return pre, dec

            (pre, dec), dt = self._executables(("ar", cfg, b), lower)
            t0 = time.perf_counter()
            state = jax.block_until_ready(pre(self._lm_t, *args))
            t1 = time.perf_counter()
            state = jax.block_until_ready(dec(self._lm_t, state, temps))
            t2 = time.perf_counter()
            return self._result(state, name, t1 - t0, t2 - t1, dt, draft_forwards=0)

        pol = cfg.policy
        statics = (cfg, self.draft_spec)
        alpha0 = np.full((b,), pol.alpha_init if alpha_init is None else alpha_init, np.float32)
        n_b, d_b = (pol.n_max, pol.d_cap) if budget is None else budget
        if not (1 <= n_b <= pol.n_max and 1 <= d_b <= pol.d_cap):
            raise ValueError(f"budget {budget} outside [1, {pol.n_max}] x [1, {pol.d_cap}]")
        args = (tokens, pad, temps, max_new, key, alpha0, np.full((b,), n_b, np.int32), np.full((b,), d_b, np.int32))

        def lower():
            pre = jax.jit(_prefill_spec, static_argnums=(0, 1)).lower(*statics, self._lm_t, self._lm_d, *args).compile()
            st = jax.eval_shape(functools.partial(_prefill_spec, *statics), self._lm_t, self._lm_d, *args)
            dec = jax.jit(_decode_spec, static_argnums=(0, 1), donate_argnums=4).lower(
                *statics, self._lm_t, self._lm_d, st, temps).compile()
            return pre, dec

        (pre, dec), dt = self._executables(("spec", cfg, self.draft_spec, b), lower)
        t0 = time.perf_counter()
        state = jax.block_until_ready(pre(self._lm_t, self._lm_d, *args))
        t1 = time.perf_counter()
        state = jax.block_until_ready(dec(self._lm_t, self._lm_d, state, temps))
        t2 = time.perf_counter()
        gen = self._result(state, name, t1 - t0, t2 - t1, dt, draft_forwards=int(state.draft_forwards))
        gen.stats.draft_width, gen.stats.verify_width = int(state.draft_width), int(state.verify_width)
        gen.stats.accepted_at = np.asarray(state.accepted_at).tolist()
        gen.stats.width_trace = np.asarray(state.width_trace)[: gen.stats.steps].tolist()
        gen.stats.budget = (int(n_b), int(d_b))
        return gen

    def _result(self, state, name, t_pre, t_dec, t_compile, *, draft_forwards) -> Generation:
        out, n_gen = np.asarray(state.out), np.asarray(state.n_gen)
        ids = [out[i, : n_gen[i]].tolist() for i in range(out.shape[0])]
        steps = int(state.steps)
        if name == "ar":
            mean_tau, alpha, depth, nodes, taus = 0.0, [], [], [], []
        else:
            n_steps = np.maximum(np.asarray(state.n_steps), 1)
            mean_tau = float(np.sum(np.asarray(state.sum_tau)) / np.sum(n_steps))
            alpha = [float(a) for a in np.asarray(state.alpha_trace)[:steps]]
            depth = np.asarray(state.depth_trace)[:steps].tolist()
            nodes = np.asarray(state.nodes_trace)[:steps].tolist()
            taus = np.asarray(state.tau_trace)[:steps].tolist()
        new = int(n_gen.sum())
        loop_tokens = new - len(ids)  # the first token of each row comes from the prefill
        stats = Stats(
            new_tokens=new, steps=steps, target_forwards=steps + 1, draft_forwards=draft_forwards,
            mean_accepted=mean_tau, mean_tokens_per_step=mean_tau + 1.0,
            tokens_per_second=loop_tokens / t_dec if t_dec > 0 and loop_tokens > 0 else 0.0,
            prefill_seconds=t_pre, decode_seconds=t_dec, compile_seconds=t_compile, compiles=self.compiles,
            alpha_trace=alpha, depth_trace=depth, nodes_trace=nodes, tau_trace=taus,
        )
        return Generation(token_ids=ids, policy=name, stats=stats)
