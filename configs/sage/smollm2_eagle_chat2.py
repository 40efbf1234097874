"""The recipe of the head shipped until 2026-12-03 and the start of the shipped one (`smollm2_eagle_chat4`):
`smollm2_eagle_chat` plus a second block of 1,536 chat-style WordNet prompts drawn with seed 1, and 2,000 training
steps (3,452 training prompts after dropping repeats, ~300k answer tokens). The first block is exactly
`smollm2_eagle_chat`'s data: copy that work directory's `data/` in to generate only the new block. README "Drafts"
has its measured acceptance.

    python -m sage_jax.train_draft --config smollm2_eagle_chat2 --workdir runs/smollm2_eagle_chat2
"""

import dataclasses

from configs.sage import smollm2_eagle_chat
from sage_jax.training.recipe import DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle_chat.get_config()
    return dataclasses.replace(
        c, data=dataclasses.replace(c.data, extra_general_seeds=(1,)),
        eagle=dataclasses.replace(c.eagle, train=dataclasses.replace(c.eagle.train, steps=2000, eval_every=500)))
