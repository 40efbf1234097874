"""One prompt's speculative steps, tree by tree: what the draft proposed, what the target accepted, and a picture.

`step_trees(engine, prompt)` runs the engine's target and draft through the speculative loop's own pure functions
(`spec_prefill`, then per step `draft`, `verify`, `commit`, `update_policy`, `record`, in `spec_step`'s order), one
compiled step at a time, and keeps every step's tree (batch row 0) with its accepted path and bonus token. With the
same policy, `max_new_tokens` and budget the steps are those of `engine.generate([prompt], ...)`: the root of step 0
followed by each step's `new_tokens` is its output (greedy). `draw(tree)` plots one step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from configs import sharding
from sage_jax.decoding import speculative as spec
from sage_jax.decoding.drafters import DraftSpec, build_drafter
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine, run_config


@dataclasses.dataclass(frozen=True)
class StepTree:
    """One speculative step (batch row 0).

    Attributes:
      step: 0-based step of the loop.  alpha: the confidence α that shaped this tree.
      tokens, parent, depth, logp: [n] the tree's nodes (slot 0 = the root, the last committed token; parents
        before children; `parent` -1 for the root; `logp` the draft's cumulative log-probability).
      path: [τ + 1] slots of the accepted path, root first.  bonus: the target's own token after the path.
      labels: each node's token as text (its id without a tokenizer); bonus_label: the bonus token's.
    """

    step: int
    alpha: float
    tokens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    logp: np.ndarray
    path: np.ndarray
    bonus: int
    labels: tuple[str, ...]
    bonus_label: str

    @property
    def tau(self) -> int:
        """Draft tokens the target accepted (bonus excluded); at the last step more than `Stats.tau_trace`, which
        counts what was committed, when the token limit or EOS cuts the path."""
        return len(self.path) - 1

    @property
    def n_nodes(self) -> int:
        """Draft nodes (root excluded): what `Stats.nodes_trace` records."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def accepted(self) -> np.ndarray:
        """[n] whether each node lies on the accepted path (the root always does)."""
        return np.isin(np.arange(len(self.tokens)), self.path)

    @property
    def new_tokens(self) -> list[int]:
        """The tokens this step commits: the accepted draft tokens, then the bonus token (before EOS / limit cuts)."""
        return [int(t) for t in self.tokens[self.path[1:]]] + [int(self.bonus)]


def _token_text(tokenizer, token: int) -> str:
    if tokenizer is None:
        return str(int(token))
    return tokenizer.decode([int(token)])


def step_trees(engine: Engine, prompt: str | Sequence[int], *, policy: str | TreePolicy = "sage",
               max_new_tokens: int = 64, steps: int | None = None, budget: tuple[int, int] | None = None,
               alpha_init: float | None = None) -> list[StepTree]:
    """The trees of the speculative steps that greedy `engine.generate([prompt], policy=policy,
    max_new_tokens=max_new_tokens, budget=budget)` takes (the first `steps` of them; default: all, until EOS or the
    token limit). `prompt`: a string (chat-templated) or token ids; text targets only. `budget`: (node budget,
    depth cap) or None for the policy's full tree."""
    if engine.vision is not None:
        raise ValueError("step_trees takes text prompts; this engine's target is a vision-language model")
    pol = policy if isinstance(policy, TreePolicy) else TreePolicy.named(policy)
    n_b, d_b = (pol.n_max, pol.d_cap) if budget is None else budget
    if not (1 <= n_b <= pol.n_max and 1 <= d_b <= pol.d_cap):
        raise ValueError(f"budget {budget} outside [1, {pol.n_max}] x [1, {pol.d_cap}]")
    ids = engine.encode(prompt)
    engine.check_fits(len(ids), max_new_tokens, pol)
    cfg = run_config(pol, len(ids), max_new_tokens, sampling=engine.sampling,
                     eos_ids=tuple(engine.cfg.eos_token_ids), pad_id=engine.cfg.pad_token_id)
    tokens = np.full((1, cfg.prompt_len), engine.cfg.pad_token_id, np.int32)
    tokens[0, cfg.prompt_len - len(ids):] = ids
    pad = np.asarray([cfg.prompt_len - len(ids)], np.int32)
    temps = np.zeros((1,), np.float32)  # greedy: the accepted path is the target's own argmax chain
    alpha0 = np.full((1,), pol.alpha_init if alpha_init is None else alpha_init, np.float32)
    # The engine keeps its draft in serving form (an LM, an EAGLE head or None for a self-draft) without a public
    # name; it is what `Engine.generate` hands its compiled loop.
    lm_t, lm_d = engine.target_lm, engine.draft
    prefill, step = _compiled(cfg, engine.draft_spec)
    mesh = getattr(engine, "mesh", None)  # a target placed on a mesh is traced there, as `Engine.generate` does
    with sharding.use(mesh, "inference"):
        s = prefill(lm_t, lm_d, tokens, pad, temps, np.full((1,), max_new_tokens, np.int32), jax.random.key(0),
                    alpha0, np.full((1,), n_b, np.int32), np.full((1,), d_b, np.int32))
    tok = engine.tokenizer
    out: list[StepTree] = []
    while not bool(s.done[0]) and int(s.steps) < cfg.max_steps and (steps is None or len(out) < steps):
        with sharding.use(mesh, "inference"):
            s, tree, alpha, path, tau, bonus = step(lm_t, lm_d, s, temps)
        keep = np.flatnonzero(np.asarray(tree.valid[0]))  # the nodes, renumbered 0..n-1 in slot order
        new = np.full(tree.size, -1)
        new[keep] = np.arange(len(keep))
        parent = np.asarray(tree.parent[0])[keep]
        t_tokens = np.asarray(tree.tokens[0])[keep]
        out.append(StepTree(
            step=len(out), alpha=float(alpha[0]), tokens=t_tokens, parent=np.where(parent >= 0, new[parent], -1),
            depth=np.asarray(tree.depth[0])[keep], logp=np.asarray(tree.logp[0])[keep],
            path=new[np.asarray(path[0])[: int(tau[0]) + 1]], bonus=int(bonus[0]),
            labels=tuple(_token_text(tok, t) for t in t_tokens), bonus_label=_token_text(tok, int(bonus[0]))))
    return out


@functools.lru_cache(maxsize=8)
def _compiled(cfg: spec.SpecConfig, draft_spec: DraftSpec):
    """(prefill, one step) jitted for a config: repeated `step_trees` calls in one bucket compile nothing."""

    def prefill(lm_t, lm_d, *args):
        return spec.spec_prefill(cfg, lm_t, build_drafter(draft_spec, lm_t, lm_d), *args)

    def step(lm_t, lm_d, s: spec.SpecState, temperature):
        # `spec.spec_step`, keeping the step's tree and verdict (test_tree_view checks the two loops agree).
        s, d, v = spec.traced_step(cfg, lm_t, build_drafter(draft_spec, lm_t, lm_d), s, temperature)
        return s, d.tree, d.alpha_used, v.path, v.tau, v.bonus

    return jax.jit(prefill), jax.jit(step)


# ---------------------------------------------------------------------------------------------------------------
# Picture.
# ---------------------------------------------------------------------------------------------------------------

_ACCEPTED, _REJECTED, _ROOT, _BONUS = "#55a868", "#dde6f3", "#c8c8c8", "#f2b880"


def layout(parent: np.ndarray, extra_child_of: int | None = None) -> np.ndarray:
    """Vertical position of every node of a tree (x is the depth): leaves one row apart in depth-first order,
    children in slot order, a parent centred on its children. `extra_child_of`: a node that gets one more child
    (index n, placed first), e.g. the bonus token after the accepted path; then n + 1 positions are returned."""
    n = len(parent)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    if extra_child_of is not None:
        children[extra_child_of].append(n)
    for i in range(1, n):
        children[int(parent[i])].append(i)
    y = np.zeros(n + (extra_child_of is not None), float)
    row = 0
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:  # iterative post-order: a node is placed after its children
        i, seen = stack.pop()
        if not children[i]:
            y[i], row = row, row + 1
        elif seen:
            y[i] = np.mean(y[children[i]])
        else:
            stack.append((i, True))
            stack.extend((c, False) for c in reversed(children[i]))
    return y


def _show(text: str, limit: int) -> str:
    text = repr(text)[1:-1]  # newlines and tabs visible
    return text if len(text) <= limit else text[: limit - 1] + "…"


def draw(tree: StepTree, ax=None, *, max_label: int = 14, title: str | None = None):
    """Draws one step's tree left to right (x = depth): every draft node labelled with its token, the accepted
    path green with thick edges, the target's bonus token (orange, dashed) after it. Returns the matplotlib
    Figure (a new one sized to the tree when `ax` is None; pyplot is not used, so no backend is switched)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n = len(tree.tokens)
    last = int(tree.path[-1])
    y = layout(tree.parent, extra_child_of=last)
    x = np.append(tree.depth.astype(float), tree.depth[last] + 1.0)
    rows = int(y.max()) + 1
    if ax is None:
        fig = Figure(figsize=(1.6 * (x.max() + 1) + 2.4, 0.32 * rows + 1.3))
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    acc = tree.accepted
    for i in range(1, n):
        p = int(tree.parent[i])
        on = acc[i] and acc[p]
        ax.plot([x[p], x[i]], [y[p], y[i]], color=_ACCEPTED if on else "#9aa5b5", lw=2.6 if on else 0.8, zorder=1)
    ax.plot([x[last], x[n]], [y[last], y[n]], color="#d08030", lw=1.6, ls="--", zorder=1)
    for i in range(n + 1):
        if i == n:
            label, color, style = tree.bonus_label, _BONUS, "--"
        else:
            label, color, style = tree.labels[i], _ROOT if i == 0 else _ACCEPTED if acc[i] else _REJECTED, "-"
        ax.text(x[i], y[i], _show(label, max_label), ha="center", va="center", fontsize=7, zorder=2,
                parse_math=False, bbox=dict(boxstyle="round,pad=0.25", fc=color, ec="#555555", ls=style, lw=0.6))
    ax.set_xlim(-0.6, x.max() + 0.6)
    ax.set_ylim(rows - 0.4, -0.6)  # the first child on top
    ax.set_xticks(range(int(x.max()) + 1))
    ax.set_xlabel("depth (0 = root, the last committed token)")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"step {tree.step}: α = {tree.alpha:.2f} → {tree.n_nodes} draft nodes, depth "
                 f"{tree.max_depth}; the target accepted τ = {tree.tau} (+ its bonus token)", fontsize=9)
    ax.legend(handles=[Patch(fc=_ROOT, ec="#555555", label="root"), Patch(fc=_ACCEPTED, ec="#555555",
                       label="accepted"), Patch(fc=_REJECTED, ec="#555555", label="rejected"),
                       Patch(fc=_BONUS, ec="#555555", ls="--", label="bonus (target)")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig
