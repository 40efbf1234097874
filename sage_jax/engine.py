"""Host-side entry: bucket prompts, compile once per (config, bucket), run, and report statistics.

Everything that runs per token happens inside two compiled calls (prefill, then the decode loop); this module
only pads prompts with numpy, keeps the compiled executables, and times them. Compilations are counted here:
one prefill and one decode loop per (policy, sampling, batch, prompt bucket, new-token bucket).
`load_engine` builds an `Engine` from paths, with the shipped defaults.

A target placed on a mesh (`load_engine(..., mesh=...)`) is decoded there: the loops are traced under the inference
rules of `configs.sharding` on that mesh, and their results are read back with `sharding.to_host`, so the same
`generate` call runs on every process of a multi-host job (each host holding its shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from configs import sharding
from sage_jax import chat, executables
from sage_jax.decoding import autoregressive as ar
from sage_jax.decoding import budget as budget_lib
from sage_jax.decoding import cost_model, media_batch, visual_pruning, widths
from sage_jax.decoding import datastore as datastore_lib
from sage_jax.decoding import speculative as spec
from sage_jax.decoding.drafters import DraftSpec, build_drafter
from sage_jax.decoding.policies import TreePolicy
from sage_jax.decoding.sampling import SamplingConfig
from sage_jax.io import lm_checkpoint, loader
from sage_jax.io.vision_lm import VisionLM
from sage_jax.models import serving_lm
from sage_jax.models.causal_lm import CausalLM
from sage_jax.models.decoder import Decoder
from sage_jax.models.eagle_head import EagleWeights

MIN_BUCKET = 16

Prompt = str | Sequence[int] | dict  # a dict: one prompt's processor outputs (`VisionLM.inputs`)


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
    # τ: committed draft tokens per row-step, bonus token excluded (a last step cut at EOS or max_new_tokens counts
    # what it committed), so that τ + 1 = (new tokens − the prefill's first token per row) / row_steps.
    mean_accepted: float
    mean_tokens_per_step: float  # τ + 1
    tokens_per_second: float  # decode loop only (prefill and compile excluded)
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    compiles: int
    alpha_trace: list[float]
    depth_trace: list[int] = dataclasses.field(default_factory=list)
    nodes_trace: list[int] = dataclasses.field(default_factory=list)
    tau_trace: list[int] = dataclasses.field(default_factory=list)  # row 0's committed draft tokens per step
    width_trace: list[int] = dataclasses.field(default_factory=list)
    draft_width: int = 0  # summed widths of the draft forwards (tokens they ran on, incl. prefill)
    verify_width: int = 0  # summed widths of the target's verify forwards
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # committed draft nodes per priority rank
    accepted_depth: list[list[int]] = dataclasses.field(default_factory=list)  # the same per rank and depth
    # Retrieval chains (`TreePolicy.retrieval`), summed over rows: steps that merged one, the nodes they added to
    # the trees, and the accepted tokens on those nodes.
    retrieval_steps: int = 0
    retrieval_nodes: int = 0
    retrieval_accepted: int = 0
    budget: tuple[int, int] | None = None  # (node budget, depth cap) the run used; (0, 0): decoded plainly
    row_steps: int = 0  # steps summed over the batch's rows while each was still decoding (τ's denominator)
    prompt_tokens: int = 0  # the prompts' tokens, summed over the batch (visual tokens included)
    draft_prompt_tokens: int = 0  # the prompt tokens the draft's prefill saw (fewer with visual-token pruning)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        pruned = (f" | the draft read {self.draft_prompt_tokens} of {self.prompt_tokens} prompt tokens"
                  if 0 < self.draft_prompt_tokens < self.prompt_tokens else "")
        return (f"{self.new_tokens} tokens in {self.steps} steps | τ {self.mean_accepted:.2f} "
                f"(τ+1 {self.mean_tokens_per_step:.2f}) | {self.tokens_per_second:.1f} tok/s decode | "
                f"target fwd {self.target_forwards}, draft fwd {self.draft_forwards} | "
                f"prefill {self.prefill_seconds:.2f}s, compile {self.compile_seconds:.1f}s ({self.compiles} compiles)"
                f"{pruned}")


@dataclasses.dataclass
class _Batch:
    """Prompts as `Engine.generate` decodes them: token ids, and for a vision-language target their processor
    outputs, the visual tokens the draft keeps per row ([B, 2]) and the draft's prompt lengths."""

    ids: list[list[int]]
    vision: media_batch.VisionPrompts | None = None
    keep: np.ndarray | None = None
    draft_lens: list[int] | None = None


@dataclasses.dataclass
class Generation:
    """What `Engine.generate` returns: the new token ids of every prompt (EOS included when reached), the policy
    that decoded them, the statistics, and the text up to EOS when the engine has a tokenizer."""

    token_ids: list[list[int]]
    policy: str
    stats: Stats
    text: list[str] | None = None


class Engine:
    """A target LM or vision-language model (+ a draft) ready to generate with any policy.

    Args:
      target: the target, a `CausalLM` (from `sage_jax.load`), an NNX `Decoder`, a serving-form `LM` (from
        `sage_jax.io.loader.load_serving`: one copy of the weights, what `load_engine` builds), or a `VisionLM`
        (Qwen2.5-VL, LLaVA-OneVision): prompts then take images and videos.
      draft: a separate draft LM with the target's vocabulary (`CausalLM` or `Decoder`; for a vision-language
        target a smaller `VisionLM` of its family, which sees the images through its own tower), an EAGLE-style
        head (`EagleWeights`), or None.
      draft_spec: derived from `draft` by default; `DraftSpec(kind="self", n_layers=k)` for a self-draft (the
        default without a draft: a third of the target's layers).
      sampling: static top-k / top-p settings.
      tokenizer: for text prompts and `Generation.text` (default: the target `CausalLM`'s).
      profile_dir: where measured cost profiles are kept (`budget="auto"`); default `<cache dir>/profiles`.
      acceptance_prior: {policy name: `AcceptanceStats.to_json()`}, the draft's acceptance measured elsewhere
        (`load_engine` reads a draft checkpoint's `acceptance.json`): seeds `budget="auto"` for policies of the
        same sizes.
      description: how the draft is named in reports (default: its kind).
      prune_ratio: the share of (image, video) tokens the draft does not see (`visual_pruning`; default the
        paper's (0.8, 0.9); 0 = the draft sees every visual token); one number sets both.
      prune: how the draft's visual tokens are chosen: "attention" (ranked by the target's prefill attention from
        the prompt's text) or "uniform".
      attention: how the decoding loops' cache-reading forwards (verify, draft levels, catch-up, a plain decode
        step; prefills stay on XLA) attend: "xla" or "pallas" (`pallas_kernels.tree_attention`; interpreted on CPU,
        so there only a check, not a speed-up). ValueError when a model's head dim has no kernel.
      matmul: how the models' layers multiply by their weights (`LMConfig.matmul`): "auto" (on CPU, a decode or
        verify step's few float32 rows through `cpu_kernels.skinny_matmul`'s kernel), "xla" (XLA's dot), or
        "exact": shape-invariant numerics, speculative output equal to plain decoding's bit for bit in any dtype.
      datastore: the target's own answers as n-gram continuations (`decoding/datastore.py`), for policies with
        `TreePolicy.datastore` (`load_engine` reads a draft checkpoint's datastore.npz).
    """

    def __init__(self, target: CausalLM | Decoder | VisionLM | serving_lm.LM,
                 draft: CausalLM | Decoder | EagleWeights | VisionLM | None = None, *,
                 draft_spec: DraftSpec | None = None, sampling: SamplingConfig | None = None, tokenizer=None,
                 profile_dir: str | None = None, acceptance_prior: dict[str, dict] | None = None,
                 description: str | None = None,
                 prune_ratio: float | tuple[float, float] = visual_pruning.DEFAULT_RATIOS,
                 prune: visual_pruning.Method = "attention", attention: str = "xla", matmul: str = "auto",
                 datastore: datastore_lib.Datastore | None = None):
        if isinstance(target, CausalLM | VisionLM) and tokenizer is None:
            tokenizer = target.tokenizer
        self.vision = target if isinstance(target, VisionLM) else None
        self.draft_vision = draft if isinstance(draft, VisionLM) else None
        media_batch.check_pair(self.vision, draft)
        if prune not in visual_pruning.METHODS:
            raise ValueError(f"prune must be one of {visual_pruning.METHODS}, got {prune!r}")
        self.prune = prune
        self.prune_ratio = media_batch.ratios(prune_ratio)
        # once: the loops never see the NNX modules
        self._lm_t = target.serving().with_attention(attention).with_matmul(matmul)
        # A serving-form target is kept as the loops run it, and a VLM target with the language model the loops
        # run: tensor-parallel in the exact mode, its o and down projections are placed anew
        # (`serving_lm.exact_layout`), and holding the old placement too would keep two copies of them on every
        # device.
        if isinstance(target, serving_lm.LM):
            target = self._lm_t
        elif self.vision is not None and self._lm_t is not target.serving():
            target = self.vision = target.with_serving(self._lm_t)
        self.target = target
        serving_lm.prepare_matmul(self._lm_t.cfg)  # the skinny CPU kernel, built and loaded before the loops are traced
        self.attention, self.matmul = attention, matmul
        self.cfg = self._lm_t.cfg
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        if draft_spec is None:
            if isinstance(draft, EagleWeights):
                draft_spec = DraftSpec(kind="eagle")
            elif draft is not None:
                draft_spec = DraftSpec(kind="model")
            else:
                draft_spec = DraftSpec(kind="self", n_layers=self_draft_layers(self.cfg.n_layers))
        self.draft_spec = draft_spec
        self._lm_d = draft.serving() if isinstance(draft, CausalLM | Decoder | VisionLM) else draft
        if self._lm_d is not None:
            self._lm_d = self._lm_d.with_attention(attention).with_matmul(matmul)
        build_drafter(draft_spec, self._lm_t, self._lm_d)  # validates vocab / layer counts now, not inside jit
        self.profile_dir = profile_dir or os.path.join(loader.cache_dir(), "profiles")
        self.mesh = sharding.mesh_of(self._lm_t)  # where the target's parameters are placed (None: one device)
        if datastore is not None and self.mesh is not None:  # small: replicated on every device of the mesh
            repl = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            datastore = jax.tree.map(lambda x: sharding.place(x, repl), datastore)
        self.datastore = datastore
        self.acceptance_prior = dict(acceptance_prior or {})
        self.description = description or (
            f"self ({draft_spec.n_layers} layers)" if draft_spec.kind == "self" else draft_spec.kind)
        self._compiled: dict[tuple, tuple[Any, Any]] = {}
        # `budget="auto"` compiles the loop at the budget it picks (`TreePolicy.fitted`): a program the size of the
        # trees it will build, quicker to load and to run, but one more compile whenever the pick changes. For a
        # command that serves one request (`python -m sage_jax.generate`); servers keep one program per policy.
        self.fit_budget = False
        # Width buckets of the speculative loops (`SpecConfig.bucket_ratio`): each is one more compiled copy of a
        # forward, which pays where a forward's cost grows with its rows (a CPU); 1 compiles one copy of each (a
        # verify always at its tree's full width: where the cost is flat, on an accelerator, nothing is lost).
        self.bucket_ratio = spec.SpecConfig.bucket_ratio
        # Where compiled loops are kept for later processes (`executables.Store`; None: not kept). Single device only.
        self.executables: executables.Store | None = None
        self._choosers: dict[tuple, budget_lib.BudgetChooser] = {}
        self._to_measure: dict[tuple, Callable[[], budget_lib.CostProfile]] = {}
        self._timers: dict[tuple, tuple] = {}
        self.compile_seconds = 0.0

    @property
    def target_lm(self):
        """The target in serving form (`sage_jax.models.serving_lm.LM`): what the compiled loops run."""
        return self._lm_t

    @property
    def draft(self):
        """The draft as the compiled loops run it: a draft model's serving form (`serving_lm.LM`), an EAGLE head
        (`EagleWeights`), or None for a self-draft (the target's first layers, `draft_spec.n_layers`)."""
        return self._lm_d

    def _placed(self):
        """The inference rules on the target's mesh (nothing without one): where the loops are traced, so that the
        model code's sharding constraints (`configs.sharding.shard`, `map_shards`) resolve on that mesh."""
        return sharding.use(self.mesh, "inference") if self.mesh is not None else contextlib.nullcontext()

    @property
    def compiles(self) -> int:
        """Executables compiled so far (2 per configuration: prefill and decode loop)."""
        return 2 * len(self._compiled)

    # ------------------------------------------------------------------ prompts

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string is chat-templated with the tokenizer, ids pass through."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine has none (pass token ids)")
            ids = chat.prompt_ids(self.tokenizer, prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("every prompt needs at least one token")
        return ids

    def check_fits(self, prompt_len: int, max_new_tokens: int, policy: str | TreePolicy = "sage",
                   visual: int = 0) -> None:
        """ValueError when a prompt of `prompt_len` tokens (`visual` of them visual) plus `max_new_tokens`
        (bucketed, plus the tree's slack) needs more cache slots than the target's context."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = run_config(policy, prompt_len, max_new_tokens).capacity
        if need > self.cfg.max_position:
            name = policy if isinstance(policy, str) else policy.name
            of = f" ({visual} of them visual tokens of its images and videos)" if visual else ""
            raise ValueError(f"a prompt of {prompt_len} tokens{of} + {max_new_tokens} new tokens needs {need} cache "
                             f"slots with policy {name}, more than the target's context ({self.cfg.max_position})")

    # ------------------------------------------------------------------ budgets

    def chooser(self, policy: str | TreePolicy, prompt_len: int = 256, max_new_tokens: int = 128
                ) -> budget_lib.BudgetChooser:
        """The budget chooser of a policy (its cost profile measured on this device on first use, or loaded
        from the profile cache), shared by every `generate(budget="auto")` call with that policy."""
        cfg = run_config(policy, prompt_len, max_new_tokens)
        pol = cfg.policy
        key = (pol, self.draft_spec)
        if key not in self._choosers:
            v_sizes = widths.verify_sizes(pol.tree_size, cfg.bucket_ratio, pol.retrieval)
            d_sizes = widths.draft_sizes(pol.frontier, cfg.bucket_ratio)
            desc = f"{self.draft_spec}|{self._lm_d.cfg if self._lm_d is not None else None}"
            pkey = budget_lib.profile_key(self.cfg, desc, cfg.capacity, v_sizes, d_sizes)
            measure = functools.partial(self._measured_profile, pkey, cfg.capacity, v_sizes, d_sizes)
            prof = None
            if not budget_lib.has_profile(pkey, self.profile_dir):
                prof = self._modelled_profile(cfg.capacity, v_sizes, d_sizes)
            if prof is None:
                prof = measure()
            else:  # an accelerator: the cost model's profile until the first request has run
                self._to_measure[key] = measure
            # The datastore chain is ungated, so with it the chains alone are no cheap fallback.
            ch = budget_lib.BudgetChooser(prof, n_max=pol.n_max, d_cap=pol.d_cap, frontier=pol.frontier,
                                          chains=bool(pol.retrieval) and not pol.datastore)
            prior = self.acceptance_prior.get(pol.name)
            if prior and (prior["n_max"], prior["d_cap"]) == (pol.n_max, pol.d_cap):
                ch.acceptance.add(budget_lib.AcceptanceStats.from_json(prior))
            self._choosers[key] = ch
        return self._choosers[key]

    def _measured_profile(self, pkey: str, capacity: int, v_sizes, d_sizes) -> budget_lib.CostProfile:
        with self._placed():  # timed as the loops run, on the target's mesh
            return budget_lib.cached_profile(pkey, lambda: budget_lib.measure_profile(
                self._lm_t, self._lm_d, self.draft_spec, capacity, v_sizes, d_sizes), self.profile_dir)

    def cost_arches(self, dtype: str | None = None) -> tuple[cost_model.Arch, cost_model.Arch]:
        """The cost model's shapes of the target and of its draft (their weights and caches in `dtype`; default:
        as loaded), e.g. to project this pair's speed on another chip (`cost_model.auto_choice`)."""
        target = cost_model.Arch.of(self.cfg, dtype)
        draft = cost_model.draft_arch(self.draft_spec, self.cfg, self._lm_d)
        if dtype is not None:
            size = cost_model.Arch.of(self.cfg, dtype).weight_bytes
            draft = dataclasses.replace(draft, weight_bytes=size, cache_bytes=size)
        return target, draft

    def _modelled_profile(self, capacity: int, v_sizes, d_sizes) -> budget_lib.CostProfile | None:
        """On a TPU or GPU the cost model knows (`cost_model.chip_for`), its predicted profile, so that the first
        request already drafts the trees that pay there; None on a CPU or an unknown chip (measured at once)."""
        chip = cost_model.device_chip()
        if chip is None:
            return None
        tp = sharding.tensor_parallelism(self.mesh)
        return cost_model.predicted_profile(
            cost_model.Arch.of(self.cfg), cost_model.draft_arch(self.draft_spec, self.cfg, self._lm_d), chip,
            v_sizes, d_sizes, context=capacity // 2, tp=tp)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Prompt], *, policy: str | TreePolicy = "sage", max_new_tokens: int = 128,
                 temperature: float | Sequence[float] = 0.0, seed: int = 0, alpha_init: float | None = None,
                 budget: tuple[int, int] | str | None = None, images: Sequence[Sequence] | None = None,
                 videos: Sequence[Sequence] | None = None,
                 prune_ratio: float | tuple[float, float] | None = None) -> Generation:
        """Generates for a batch of prompts (strings, chat-templated with the tokenizer, or token ids; left-padded
        internally).

        `policy`: "ar", a policy name or a `TreePolicy`. `temperature`: one value or one per prompt (0 = greedy;
        sampled rows keep the target's exact distribution). `alpha_init`: SAGE's confidence for the first tree
        (default: the policy's). `budget`: (node budget, depth cap) at most the policy's static (n_max, d_cap);
        arrays in the compiled loop, so any value reuses the compilation (default: the static sizes; a node budget
        of 0 with a retrieval policy verifies its chains alone, and the draft then runs no forward); "auto":
        chosen by `chooser(policy)` from the measured cost profile and the acceptance statistics of earlier calls,
        which this call then extends (when no tree is predicted to pay: a policy with a prompt-lookup chain and
        no datastore verifies it alone, budget (0, d_cap), gated by `TreePolicy.chains_gate`; any other decodes
        plainly, reported as budget (0, 0) under the requested policy's name).

        A vision-language target also takes `images` / `videos` (one sequence per prompt: PIL images or paths;
        frame arrays [F, H, W, 3] or paths) or prompts given as processor outputs (`VisionLM.inputs`);
        `prune_ratio` overrides the engine's for this call. The target sees every visual token, the draft the
        kept ones; any number and size of images reuses the compilation while the prompt lengths (the target's,
        and the draft's after pruning) stay in their buckets.
        """
        if not prompts:
            raise ValueError("no prompts")
        if self.vision is None:
            if images is not None and any(len(i) for i in images) or videos is not None and any(
                    len(v) for v in videos) or any(isinstance(p, dict) for p in prompts):
                raise ValueError("images and videos need a vision-language target (Qwen2.5-VL or LLaVA-OneVision); "
                                 "this engine's target is a text LM")
            batch = _Batch(ids=[self.encode(p) for p in prompts])
        else:
            vis = media_batch.prepare(self.vision, prompts, images, videos)
            ratios = self.prune_ratio if prune_ratio is None else media_batch.ratios(prune_ratio)
            keep, lens = media_batch.draft_lengths(vis, ratios)
            batch = _Batch(ids=vis.ids, vision=vis, keep=keep, draft_lens=lens)
        if budget == "auto":
            return self._generate_auto(batch, policy, max_new_tokens, temperature, seed, alpha_init)
        if isinstance(budget, str):
            raise ValueError(f"budget must be (nodes, depth), None or 'auto', got {budget!r}")
        return self._generate(batch, policy, max_new_tokens, temperature, seed, alpha_init, budget)

    def _generate(self, batch: _Batch, policy, max_new_tokens, temperature, seed, alpha_init, budget) -> Generation:
        ids = batch.ids
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        visual = 0 if batch.vision is None else int(batch.vision.n_visual[longest].sum())
        self.check_fits(len(ids[longest]), max_new_tokens, policy, visual)
        temps = np.broadcast_to(np.asarray(temperature, np.float32), (len(ids),)).copy()
        if np.any(temps < 0) or not np.all(np.isfinite(temps)):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        cfg, tokens, pad, media = self._inputs(batch, policy, max_new_tokens)
        head = (tokens, pad, temps, np.full((len(ids),), max_new_tokens, np.int32), jax.random.key(seed))
        has_media = media is not None
        if policy == "ar":
            state, times = self._run(("ar", cfg, len(ids), has_media), functools.partial(ar.ar_prefill, cfg),
                                     functools.partial(ar.ar_decode, cfg), (self._lm_t,), (*head, media), temps)
            gen = self._result(state, "ar", times, draft_forwards=0)
            gen.stats.prompt_tokens = sum(map(len, ids))
            return gen
        pol = cfg.policy
        n_b, d_b = (pol.n_max, pol.d_cap) if budget is None else budget
        lo = 0 if pol.retrieval else 1  # with retrieval chains, node budget 0 verifies the chains alone
        if not (lo <= n_b <= pol.n_max and 1 <= d_b <= pol.d_cap):
            raise ValueError(f"budget {budget} outside [{lo}, {pol.n_max}] x [1, {pol.d_cap}]")
        b = len(ids)
        alpha0 = np.full((b,), pol.alpha_init if alpha_init is None else alpha_init, np.float32)
        args = (*head, alpha0, np.full((b,), n_b, np.int32), np.full((b,), d_b, np.int32), media)
        spec_d = self.draft_spec
        store = self.datastore if pol.datastore else None
        if pol.datastore and store is None:
            raise ValueError("this policy merges a datastore chain, but the engine has no datastore (a draft "
                             "checkpoint with datastore.npz, or Engine(datastore=...); `python -m "
                             "sage_jax.build_datastore` makes one)")

        def prefill(lm_t, lm_d, store, *a):
            return spec.spec_prefill(cfg, lm_t, build_drafter(spec_d, lm_t, lm_d), *a)

        def decode(lm_t, lm_d, store, state, t):
            return spec.spec_decode(cfg, lm_t, build_drafter(spec_d, lm_t, lm_d), state, t, store)

        state, times = self._run(("spec", cfg, spec_d, b, has_media), prefill, decode,
                                 (self._lm_t, self._lm_d, store), args, temps)
        gen = self._result(state, pol.name, times, draft_forwards=int(state.draft_forwards))
        st = gen.stats
        st.prompt_tokens = sum(map(len, ids))
        st.draft_width, st.verify_width = int(state.draft_width), int(state.verify_width)
        st.accepted_depth = np.asarray(state.accepted_depth).tolist()
        st.accepted_at = np.sum(st.accepted_depth, 1).tolist()
        st.retrieval_steps, st.retrieval_nodes = int(state.r_steps), int(state.r_nodes)
        st.retrieval_accepted = int(state.r_accepted)
        st.width_trace = np.asarray(state.width_trace)[: st.steps].tolist()
        st.budget = (int(n_b), int(d_b))
        st.draft_prompt_tokens = sum(batch.draft_lens) if cfg.draft_prompt_len else st.prompt_tokens
        return gen

    def _inputs(self, batch: _Batch, policy, max_new_tokens: int):
        """The static config of a batch (prompt buckets, for a pruned draft its own), the left-padded tokens and
        padding, and the batch's `Media` (None for text)."""
        ids = batch.ids
        buckets = {} if policy == "ar" else {"bucket_ratio": self.bucket_ratio}
        cfg = run_config(policy, max(len(p) for p in ids), max_new_tokens, sampling=self.sampling,
                         eos_ids=tuple(self.cfg.eos_token_ids), pad_id=self.cfg.pad_token_id, **buckets)
        tokens, pad = self._left_padded(ids, cfg.prompt_len, self.cfg.pad_token_id)
        if batch.vision is None:
            return cfg, tokens, pad, None
        media = media_batch.media(self.vision, self.draft_vision, batch.vision, cfg.prompt_len,
                                  self.cfg.pad_token_id, batch.keep)
        if policy != "ar" and any(n < len(i) for n, i in zip(batch.draft_lens, ids, strict=True)):
            cfg = dataclasses.replace(cfg, draft_prompt_len=bucket(max(batch.draft_lens)), prune=self.prune)
        return cfg, tokens, pad, media

    def time_prefill(self, prompts: Sequence[Prompt], *, images=None, videos=None,
                     prune_ratio: float | tuple[float, float] | None = None, policy: str | TreePolicy = "sage",
                     max_new_tokens: int = 128, repeats: int = 3) -> dict[str, float]:
        """Seconds of a vision-language batch's two prefills, each compiled on its own and timed apart (median of
        `repeats`, compilation excluded): the target's over every visual token (with the attention ranking), and
        the draft's over the tokens it keeps; with XLA's count of each compiled prefill's floating-point operations
        (a noise-free measure of the same saving). What the bench reports per pruning ratio."""
        if self.vision is None:
            raise ValueError("time_prefill measures vision-language prompts; this engine's target is a text LM")
        vis = media_batch.prepare(self.vision, prompts, images, videos)
        ratios = self.prune_ratio if prune_ratio is None else media_batch.ratios(prune_ratio)
        keep, lens = media_batch.draft_lengths(vis, ratios)
        cfg, tokens, pad, media = self._inputs(_Batch(ids=vis.ids, vision=vis, keep=keep, draft_lens=lens), policy,
                                               max_new_tokens)
        spec_d, b = self.draft_spec, len(vis.ids)
        taps = getattr(self._lm_d, "taps", ())  # an EAGLE-3-style head reads tapped layer inputs

        def target(lm_t, tokens, pad, media):
            return spec.target_prefill_media(cfg, lm_t, tokens, pad, media, lm_t.init_cache(b, cfg.capacity), taps)

        def draft(lm_t, lm_d, tokens, pad, media, hidden, keep):
            drafter = build_drafter(spec_d, lm_t, lm_d)
            return spec.draft_prefill_media(cfg, drafter, tokens, pad, media, hidden, keep,
                                            drafter.init_cache(b, cfg.draft_capacity))

        key = ("time_prefill", cfg, spec_d, b)
        if key not in self._timers:
            t_fn = jax.jit(target).lower(self._lm_t, tokens, pad, media).compile()
            _, _, kept, hidden = t_fn(self._lm_t, tokens, pad, media)
            d_fn = jax.jit(draft).lower(self._lm_t, self._lm_d, tokens, pad, media, hidden, kept).compile()
            self._timers[key] = (t_fn, d_fn, _flops(t_fn), _flops(d_fn))
        t_fn, d_fn, t_flops, d_flops = self._timers[key]
        _, _, kept, hidden = jax.block_until_ready(t_fn(self._lm_t, tokens, pad, media))

        def median(fn, *a):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                times.append(time.perf_counter() - t0)
            return float(np.median(times))

        return {"target_prefill_seconds": median(t_fn, self._lm_t, tokens, pad, media),
                "draft_prefill_seconds": median(d_fn, self._lm_t, self._lm_d, tokens, pad, media, hidden, kept),
                "target_prefill_flops": t_flops, "draft_prefill_flops": d_flops,
                "prompt_tokens": sum(map(len, vis.ids)),
                "draft_prompt_tokens": sum(lens) if cfg.draft_prompt_len else sum(map(len, vis.ids))}

    def _generate_auto(self, batch: _Batch, policy, max_new_tokens, temperature, seed, alpha_init) -> Generation:
        """`generate(budget="auto")`: the chooser's budget; where no tree is predicted to pay, the prompt-lookup
        chain verified alone (`BudgetChooser.chains`: retrieval without a datastore), else plain decoding."""
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, alpha_init=alpha_init)
        if policy == "ar":
            return self._generate(batch, "ar", budget=None, **kw)
        ch = self.chooser(policy, max(len(p) for p in batch.ids), max_new_tokens)
        choice = ch.choose()
        if choice is None:
            gen = self._generate(batch, "ar", budget=None, **kw)
            gen.policy = policy if isinstance(policy, str) else policy.name
            gen.stats.budget = (0, 0)
            return gen
        named = TreePolicy.named(policy) if isinstance(policy, str) else policy
        fitted = named.fitted(*choice) if self.fit_budget else named
        gen = self._generate(batch, fitted, budget=choice, **kw)
        ch.update(gen.stats)
        key = next(k for k, c in self._choosers.items() if c is ch)
        if key in self._to_measure:  # the modelled profile served the first request; this device's times now
            ch.profile = self._to_measure.pop(key)()
        return gen

    @staticmethod
    def _left_padded(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(ids), width), pad_id, np.int32)
        for i, p in enumerate(ids):
            tokens[i, width - len(p):] = p
        return tokens, np.asarray([width - len(p) for p in ids], np.int32)

    def _run(self, key: tuple, prefill: Callable, decode: Callable, models: tuple, args: tuple, temps: np.ndarray
             ) -> tuple[Any, tuple[float, float, float]]:
        """Compiles `prefill(*models, *args)` and `decode(*models, state, temps)` once per `key`, then runs both.
        Returns the final loop state (its fields read as numpy, `_OnHost`) and (prefill, decode, compile) seconds
        of this call."""
        compile_s = 0.0
        if key not in self._compiled:
            t0 = time.perf_counter()
            store = self.executables if self.mesh is None else None
            stored = executables.key("loops", key, (models, args, temps)) if store is not None else None
            loaded = store.get(stored) if store is not None else None
            if loaded is not None:
                pre, dec = loaded
            else:
                with self._placed(), executables.fresh() if store is not None else contextlib.nullcontext():
                    pre = jax.jit(prefill).lower(*models, *args).compile()
                    # The decode loop is compiled for the state as the prefill places it (on a mesh, its own choice).
                    state = jax.tree.map(lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                                         jax.eval_shape(prefill, *models, *args), pre.output_shardings)
                    dec = jax.jit(decode, donate_argnums=len(models)).lower(*models, state, temps).compile()
                if store is not None:
                    store.put(stored, (pre, dec))
            self._compiled[key] = (pre, dec)
            compile_s = time.perf_counter() - t0
            self.compile_seconds += compile_s
        pre, dec = self._compiled[key]
        t0 = time.perf_counter()
        state = jax.block_until_ready(pre(*models, *args))
        t1 = time.perf_counter()
        state = jax.block_until_ready(dec(*models, state, temps))
        return _OnHost(state), (t1 - t0, time.perf_counter() - t1, compile_s)

    def _result(self, state, name: str, times: tuple[float, float, float], *, draft_forwards: int) -> Generation:
        t_pre, t_dec, t_compile = times
        out, n_gen = np.asarray(state.out), np.asarray(state.n_gen)
        ids = [out[i, : n_gen[i]].tolist() for i in range(out.shape[0])]
        steps = int(state.steps)
        if name == "ar":
            mean_tau, alpha, depth, nodes, taus, row_steps = 0.0, [], [], [], [], steps * len(ids)
        else:
            row_steps = int(np.sum(np.asarray(state.n_steps)))
            mean_tau = float(np.sum(np.asarray(state.sum_tau)) / max(row_steps, 1))
            alpha = [float(a) for a in np.asarray(state.alpha_trace)[:steps]]
            depth = np.asarray(state.depth_trace)[:steps].tolist()
            nodes = np.asarray(state.nodes_trace)[:steps].tolist()
            # Row 0's τ only while it decodes: a batch goes on after it stops, and those steps would read as τ = 0
            # (the acceptance priors' depth histograms, `budget.AcceptanceStats.update`, count these).
            taus = np.asarray(state.tau_trace)[: int(np.asarray(state.n_steps)[0])].tolist()
        new = int(n_gen.sum())
        loop_tokens = new - len(ids)  # the first token of each row comes from the prefill
        stats = Stats(
            new_tokens=new, steps=steps, target_forwards=steps + 1, draft_forwards=draft_forwards,
            mean_accepted=mean_tau, mean_tokens_per_step=mean_tau + 1.0,
            tokens_per_second=loop_tokens / t_dec if t_dec > 0 and loop_tokens > 0 else 0.0,
            prefill_seconds=t_pre, decode_seconds=t_dec, compile_seconds=t_compile, compiles=self.compiles,
            alpha_trace=alpha, depth_trace=depth, nodes_trace=nodes, tau_trace=taus, row_steps=row_steps,
        )
        text = None
        if self.tokenizer is not None:
            text = [chat.decode(self.tokenizer, t, self.cfg.eos_token_ids) for t in ids]
        return Generation(token_ids=ids, policy=name, stats=stats, text=text)


class _OnHost:
    """A final loop state whose fields read as numpy (`sharding.to_host`: on a multi-host mesh, gathered from every
    host, so each process reads the same fields in the same order)."""

    def __init__(self, state):
        self._state, self._read = state, {}

    def __getattr__(self, name: str) -> np.ndarray:
        if name not in self._read:
            self._read[name] = sharding.to_host(getattr(self._state, name))
        return self._read[name]


def _flops(compiled) -> float:
    """XLA's floating-point operation count of a compiled function (0 where the backend gives none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float((cost or {}).get("flops", 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Loading an engine from paths.
# ---------------------------------------------------------------------------------------------------------------


def self_draft_layers(n_layers: int) -> int:
    """The default self-draft: the target's first third (10 of SmolLM2's 30 layers)."""
    return max(1, n_layers // 3)


def load_engine(target: str | os.PathLike | CausalLM | VisionLM | None = None,
                draft: str | os.PathLike | CausalLM | VisionLM | None = None, draft_layers: int | None = None, *,
                sampling: SamplingConfig | None = None, dtype: str | None = None, mesh=None,
                prune_ratio: float | tuple[float, float] = visual_pruning.DEFAULT_RATIOS,
                prune: visual_pruning.Method = "attention", attention: str = "xla", matmul: str = "auto") -> Engine:
    """An `Engine` from paths, with the shipped defaults.

    `target`: a GGUF file, an HF directory, our LM or VLM checkpoint, or a loaded `CausalLM` / `VisionLM`
    (default: the shipped SmolLM2-135M-Instruct). `draft`: an LM with the target's vocabulary (the same kinds; for
    a vision-language target a smaller VLM of its family), or an EAGLE-style head checkpoint (default: for the
    default target the shipped head, for the shipped VLM around it (`loader.DEFAULT_VLM`) that head fine-tuned on
    the VLM's answers; otherwise a self-draft). `draft_layers`: a self-draft of the target's first N layers
    instead (default without a draft: a third of them). `dtype`, `mesh`: as `sage_jax.load`.
    `prune_ratio`, `prune`: the draft's visual-token pruning; `attention`: "xla" or "pallas", `matmul`: "auto",
    "xla" or "exact" (`Engine`). Bad
    paths and models that do not fit each other raise FileNotFoundError or ValueError with a one-line message.
    """
    if draft is not None and draft_layers is not None:
        raise ValueError("give either a draft or draft_layers, not both")
    if draft_layers is not None and draft_layers < 1:
        raise ValueError(f"draft_layers must be >= 1, got {draft_layers}")
    # The default target drafts with the shipped head by default, the shipped VLM with its own fine-tuned copy.
    shipped_vlm = isinstance(target, str | os.PathLike) and os.path.abspath(target) == loader.DEFAULT_VLM
    shipped = draft is None and draft_layers is None and (target is None or shipped_vlm)
    tokenizer = None
    spec = target if target is not None else loader.default_target()
    if isinstance(target, CausalLM | VisionLM):
        lm_t = target
    elif loader.is_vision_lm(spec):  # its language model in serving form, one copy (our checkpoints)
        lm_t = loader.load_vision_serving(spec, dtype=dtype, mesh=mesh)
    else:  # a text LM: its serving form straight from the file, one copy of the weights
        lm_t, tokenizer = loader.load_serving(spec, dtype=dtype, mesh=mesh)
    if shipped:
        draft = loader.default_vlm_draft() if shipped_vlm else loader.default_draft()
    n_layers = lm_t.serving().n_layers
    opts = dict(prune_ratio=prune_ratio, prune=prune, attention=attention, matmul=matmul)
    if draft is None:
        n = draft_layers if draft_layers is not None else self_draft_layers(n_layers)
        if n > n_layers:
            raise ValueError(f"a self-draft of {n} layers: the target has only {n_layers}")
        return Engine(lm_t, draft_spec=DraftSpec(kind="self", n_layers=n), sampling=sampling, tokenizer=tokenizer,
                      **opts)
    if isinstance(draft, CausalLM | VisionLM):
        d, desc = draft, f"{'VLM' if isinstance(draft, VisionLM) else 'LM'} {draft.source or 'in memory'}"
    elif lm_checkpoint.kind_of(draft) == lm_checkpoint.HEAD_KIND:
        serving = lm_t.serving()
        cfg, params, vocab_ids, meta = lm_checkpoint.load_head(draft, dtype=serving.cfg.dtype)
        where = sharding.mesh_of(serving)
        if where is not None:  # a one-layer head: replicated on every device of the target's mesh
            repl = jax.sharding.NamedSharding(where, jax.sharding.PartitionSpec())
            params, vocab_ids = jax.tree.map(lambda x: sharding.place(x, repl), (params, vocab_ids))
        d = EagleWeights.build(cfg, params, vocab_ids, serving.cfg, serving.embed, serving.lm_head,
                               taps=lm_checkpoint.head_taps(meta))
        desc = (f"EAGLE head {os.fspath(draft)}" if not shipped else "shipped EAGLE head (smollm2_eagle)"
                if os.fspath(draft) == loader.DEFAULT_DRAFT else "shipped EAGLE head (the VLM's, smollm2_vlm/draft)")
    else:
        d = (loader.load_vision_serving if loader.is_vision_lm(draft) else loader.load)(draft, dtype=dtype, mesh=mesh)
        desc = ("shipped draft VLM (smollm2_vlm_draft)" if shipped and os.fspath(draft) == loader.DEFAULT_VLM_DRAFT
                else f"{'VLM' if isinstance(d, VisionLM) else 'LM'} {os.fspath(draft)}")
        v_d, v_t = d.serving().cfg.vocab_size, lm_t.serving().cfg.vocab_size
        if v_d != v_t:
            raise ValueError(f"the draft's vocabulary ({v_d}) is not the target's ({v_t})")
    prior = {} if isinstance(draft, CausalLM | VisionLM) else lm_checkpoint.read_acceptance(draft).get("policies", {})
    kept = None if isinstance(draft, CausalLM | VisionLM) else datastore_lib.load(os.fspath(draft))
    return Engine(lm_t, d, sampling=sampling, acceptance_prior=prior, description=desc, datastore=kept,
                  tokenizer=tokenizer, **opts)
