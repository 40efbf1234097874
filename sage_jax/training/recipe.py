"""The frozen configs of a draft recipe (`python -m sage_jax.train_draft --config ...`): target, data, drafts.

A recipe file in `configs/sage/` is data: its `get_config()` returns an `ml_collections.ConfigDict` with
``kind = "draft"`` whose fields are `DraftRecipe`'s (a group may give only some). `DraftRecipe.from_config` validates
it (`configs.schema`); `--set a.b=value` overrides one field on the way (`configs.cli.load_config`):

    recipe = DraftRecipe.from_config(smollm2_eagle.get_config("answers6k"))

Every field that changes what is trained is here, and the whole recipe is stored in the provenance of the
checkpoints it writes.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from configs.schema import COUNT, POSITIVE, Range, Schema

DraftKind = Literal["eagle", "lm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings of one draft."""

    steps: Annotated[int, POSITIVE] = 100
    batch_size: Annotated[int, POSITIVE] = 8
    lr: Annotated[float, Range(0.0)] = 1e-3
    warmup: Annotated[int, COUNT] = 10
    weight_decay: Annotated[float, Range(0.0)] = 0.0
    clip: Annotated[float, Range(0.0)] = 1.0
    seed: int = 0
    prompt_weight: Annotated[float, Range(0.0)] = 0.1  # loss weight of prompt positions (answer positions: 1)
    feature_weight: Annotated[float, Range(0.0)] = 0.1  # λ of the feature regression (EAGLE head only)
    # > 0: the LM head / KL only on this many positions from the last prompt token on
    head_window: Annotated[int, COUNT] = 0
    unroll: Annotated[int, POSITIVE] = 1  # EAGLE head: levels of training-time test (1 = teacher forcing only)
    unroll_decay: float = 0.8  # weight of level k is unroll_decay**k
    # + this · cross-entropy on the target's argmax (greedy decoding accepts only it)
    hard_weight: Annotated[float, Range(0.0)] = 0.0
    eval_every: Annotated[int, POSITIVE] = 50
    ckpt_every: Annotated[int, POSITIVE] = 50
    log_every: Annotated[int, POSITIVE] = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The self-distillation data: prompts, then the target's own greedy answers with its features."""

    n_train: Annotated[int, COUNT] = 48  # corpus prompts (Python stdlib code, Python docs prose) for training
    n_heldout: Annotated[int, COUNT] = 16  # corpus prompts held out (other source files)
    n_general: Annotated[int, COUNT] = 0  # chat-style WordNet prompts for training (and the size of each extra block)
    n_heldout_general: Annotated[int, COUNT] = 0  # WordNet prompts held out (other lemmas)
    general_templates: Literal["basic", "extended"] = "basic"  # extended: more phrasings, summaries, advice, math
    extra_general_seeds: tuple[int, ...] = ()  # one more block of n_general WordNet prompts per seed
    gen_batch: Annotated[int, POSITIVE] = 16  # prompts per batched greedy rollout
    shard_rows: Annotated[int, POSITIVE] = 128  # rows per data shard (an interrupted rollout resumes at the next shard)
    max_new_tokens: Annotated[int, POSITIVE] = 32  # answer length
    # longer prompts are dropped (byte-encoded ones, without a tokenizer, are cut)
    max_prompt_tokens: Annotated[int, POSITIVE] = 32
    # + this many teacher-forced rows of corpus text in the assistant turn (`features.py`)
    corpus_rows: Annotated[int, COUNT] = 0
    # An answers.jsonl of `python -m sage_jax.build_datastore`: the target's greedy answers to its training prompts
    # become teacher-forced rows (`distillation.answer_rows`; those whose prompt is one of the recipe's own dropped).
    answers: str = ""
    # its first this many answers (0: all), so a recipe reads the same rows from a grown file
    n_answers: Annotated[int, COUNT] = 0
    # False: the recipe's training prompts are not answered (a head continued by `eagle.init_from` already learned
    # them); they only keep `answers` from repeating them. The held-out block is still generated.
    rollouts: bool = True
    feature_batch: Annotated[int, POSITIVE] = 8  # rows per teacher-forced target forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """The EAGLE-style head: one decoder layer over [target feature ; next-token embedding]."""

    mlp_dim: int = 0  # 0: the target's
    taps: tuple[int, ...] = ()  # EAGLE-3-style: fuse the inputs of these target layers (() = its last hidden state)
    own_head: bool = False  # a trainable final norm + LM head over the reduced vocabulary (warm-started)
    chain_depth: Annotated[int, POSITIVE] = 5  # the held-out greedy chain that the summary reports
    # A head checkpoint to continue training from: its vocabulary and taps must be the recipe's; a head without an
    # own LM head may gain one (`own_head`, warm-started from the target's rows, so it starts as that head).
    init_from: str = ""
    train: TrainConfig = TrainConfig()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMDraftConfig:
    """A separate small LM draft with the target's vocabulary."""

    n_layers: Annotated[int, POSITIVE] = 2
    d_model: Annotated[int, POSITIVE] = 32
    n_heads: Annotated[int, POSITIVE] = 4
    n_kv_heads: Annotated[int, POSITIVE] = 2
    head_dim: Annotated[int, POSITIVE] = 8
    mlp_dim: int = 64
    train: TrainConfig = TrainConfig(feature_weight=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftRecipe(Schema):
    """Everything `python -m sage_jax.train_draft` does."""

    KIND = "draft"

    target: str = "tiny"  # "default" (SmolLM2-135M-Instruct), "tiny" (random), or a GGUF / HF dir / checkpoint path
    target_seed: int = 0  # tiny only
    target_scale: float = 1.0  # tiny only: weights scaled so the target's distributions are not uniform
    seed: int = 0  # prompt sampling
    kinds: tuple[DraftKind, ...] = ("eagle",)  # the drafts to train
    vocab_size: Annotated[int, COUNT] = 0  # reduced draft vocabulary: the N most frequent ids of the data (0 = full)
    out_dtype: Literal["float32", "bfloat16"] = "bfloat16"  # of the written drafts
    data: DataConfig = DataConfig()
    eagle: EagleConfig = EagleConfig()
    lm: LMDraftConfig = LMDraftConfig()

    def __post_init__(self):
        if not self.kinds or any(k not in ("eagle", "lm") for k in self.kinds):
            raise ValueError(f"kinds must name 'eagle' and/or 'lm', got {self.kinds!r}")
        if self.data.extra_general_seeds and not self.data.n_general:
            raise ValueError("data.extra_general_seeds needs data.n_general > 0 (the size of each extra block)")
        if self.seed in self.data.extra_general_seeds:
            raise ValueError(f"data.extra_general_seeds repeats the recipe's own seed {self.seed}")
        if self.eagle.own_head and not self.vocab_size:
            raise ValueError("eagle.own_head needs a reduced vocabulary (vocab_size > 0)")
        if not self.data.rollouts and not (self.data.answers or self.data.corpus_rows):
            raise ValueError("data.rollouts=False needs training rows from data.answers or data.corpus_rows")
        if self.data.n_answers < 0 or (self.data.n_answers and not self.data.answers):
            raise ValueError("data.n_answers needs data.answers and must be >= 0")

    @property
    def sharded(self) -> bool:
        """Whether the data goes through teacher-forced feature shards (`features.py`): needed for tapped
        features, corpus rows and answer rows."""
        return bool(self.eagle.taps) or self.data.corpus_rows > 0 or bool(self.data.answers) or not self.data.rollouts

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
