"""The frozen config of a home-trained VLM (`python -m sage_jax.train_vlm --config ...`): a LLaVA-OneVision whose
language model is the shipped SmolLM2-135M-Instruct, frozen, and whose SigLIP-style tower and projector are trained
here in two stages (`sage_jax/training/vlm_stages.py`):

1. **tower**: the tower alone, as an image classifier over every source's classes (a mean-pooled linear probe,
   thrown away afterwards): cheap, and it gives the tower features that already separate the classes;
   Then the projector's last layer is fitted in closed form (ridge regression) so that each visual token lands
   on the LM's embedding of its class's name, and `image_newline` on the embedding of "\\n": the frozen LM then
   reads an image as a word it knows before any gradient flows through it;
2. **align**: tower (at a lower rate), projector and `image_newline` under the frozen language model's
   cross-entropy on the answers of the image question / answer pairs (`vlm_data.py`);
   **video** (when `video` is set): the same on batches mixing those rows with clips of Fashion-MNIST items
   (`vlm_data.clip`), asked which items appear; the model then takes videos (LLaVA-OneVision's pooled frames);
3. **draft** (when `draft` is set): the shipped EAGLE-style text head fine-tuned on the VLM's own greedy answers
   to `draft_rows` training images (`vlm_head.py`), so that the pair speculates on image prompts.

A recipe file in `configs/sage/` returns its data from `get_config()`: an `ml_collections.ConfigDict` with
``kind = "vlm"`` whose fields are `VLMRecipe`'s (`vision` those of `sage_jax.models.siglip.SiglipConfig`), validated
by `VLMRecipe.from_config`; `--set a.b=value` overrides one field on the way (`configs.cli.load_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from configs.schema import COUNT, POSITIVE, Range, Schema
from sage_jax.models.siglip import SiglipConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageConfig:
    steps: Annotated[int, POSITIVE]
    batch_size: Annotated[int, POSITIVE]
    lr: Annotated[float, Range(0.0)]
    warmup: Annotated[int, COUNT] = 20
    weight_decay: Annotated[float, Range(0.0)] = 0.0
    clip: Annotated[float, Range(0.0)] = 1.0
    ckpt_every: Annotated[int, POSITIVE] = 50
    # align stage: greedy answers on held-out Fashion-MNIST test images every N steps
    eval_every: Annotated[int, COUNT] = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLMRecipe(Schema):
    KIND = "vlm"

    vision: SiglipConfig
    tower: StageConfig
    align: StageConfig
    # video stage (when set): tower (at `tower_lr_scale`), projector and image_newline on rows of clips and images
    video: StageConfig | None = None
    video_share: Annotated[float, Range(0.0, 1.0)] = 0.5  # video stage: the share of each batch's rows that are clips
    video_seq_len: Annotated[int, POSITIVE] = 160  # video stage: tokens per row
    # A trained VLM checkpoint whose tower, projector and image_newline stand for the tower and align stages' output
    # (e.g. to add the video stage to a VLM trained without it); its sha256 goes into the provenance.
    init: str | None = None
    draft: StageConfig | None = None
    draft_rows: Annotated[int, POSITIVE] = 512  # training images the VLM answers for the draft stage
    draft_clips: Annotated[int, COUNT] = 0  # and training clips (a VLM that takes video)
    # align stage: the tower's learning rate relative to the projector's
    tower_lr_scale: Annotated[float, Range(0.0)] = 0.1
    # tower stage: weight of the per-token probe loss (every visual token classifies the image on its own, as the
    # warm start then asks each token to stand for the class's word), beside the mean-pooled probe's
    token_loss: Annotated[float, Range(0.0)] = 0.0
    shift: Annotated[int, COUNT] = 0  # tower stage: random translation of the training images by up to this many pixels
    # tower stage: the share of rows that take a random box of whole patches from another row of the batch (CutMix,
    # on the patch grid so that each visual token's probe keeps its true label; the pooled probe learns the labels
    # mixed by area). It regularises the tower, which otherwise fits its training images while held-out ones lag.
    cutmix: Annotated[float, Range(0.0, 1.0)] = 0.0
    mix: tuple[float, float, float] = (0.8, 0.12, 0.08)  # sampling weights of fashion, digits, photos
    photo_crops: Annotated[int, COUNT] = 64  # random crops of each scikit-image photo
    # align stage: tokens per row (prompt with its visual tokens, answer, padding)
    seq_len: Annotated[int, POSITIVE] = 112
    answer_len: Annotated[int, POSITIVE] = 24  # align stage: answer tokens scored per row
    warm_start: bool = True  # fit the projector's last layer by ridge regression before the align stage
    ridge_images: Annotated[int, POSITIVE] = 2048  # images whose tower features the ridge fit reads
    eval_images: Annotated[int, POSITIVE] = 32  # held-out images answered at each align evaluation
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftVLMRecipe(Schema):
    """A separate draft VLM for the home-trained VLM, as the paper drafts a 72B VLM with a small one of its family
    (`sage_jax/training/vlm_draft.py`): a LLaVA-OneVision with its own tower (the target's first `tower_layers`,
    fine-tuned), projector and image_newline, and the target LM's first `lm_layers` layers with their own final
    norm under the target's embedding and head, distilled on the target's own greedy answers while it sees a
    random share of the visual tokens (`ratios`), so that it keeps accepting when pruned."""

    KIND = "vlm_draft"

    target: str = "default"  # the VLM whose answers it learns: "default" (the shipped one) or a checkpoint path
    tower_layers: Annotated[int, POSITIVE] = 2
    lm_layers: Annotated[int, POSITIVE] = 2
    train: StageConfig
    rows: Annotated[int, POSITIVE] = 2048  # training images the target answers (the recipe's data mix)
    heldout_rows: Annotated[int, POSITIVE] = 128  # held-out Fashion-MNIST test images (past the bench's) for evals
    max_new_tokens: Annotated[int, POSITIVE] = 24  # answer tokens per row
    clip_rows: Annotated[int, COUNT] = 0  # training clips the target answers (0: images only; a video target)
    heldout_clips: Annotated[int, COUNT] = 32  # held-out clips past the bench's, for evals
    video_share: Annotated[float, Range(0.0, 1.0)] = 0.5  # the share of training steps on clip batches
    # A trained draft VLM of this shape to start from instead of the target's first layers (e.g. to teach an
    # image draft the video of a target that has since learnt it); its sha256 goes into the provenance.
    init: str | None = None
    # Pruning ratios drawn per training row (the share of visual tokens the draft does not see, kept at random).
    ratios: tuple[Annotated[float, Range(0.0, 1.0)], ...] = (0.0, 0.3, 0.6, 0.8, 0.9, 0.95)
    eval_ratios: tuple[Annotated[float, Range(0.0, 1.0)], ...] = (0.0, 0.8)
    mix: tuple[float, float, float] = (0.8, 0.12, 0.08)  # sampling weights of fashion, digits, photos
    photo_crops: Annotated[int, COUNT] = 64
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
