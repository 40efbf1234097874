"""`smollm2_eagle_chat` with a second block of 1,536 chat-style WordNet prompts (seed 1) and twice the training.

Why: with `smollm2_eagle_chat` the held-out agreement was still rising at its last step (0.26, 0.33, 0.38, 0.41
after 250..1,000 steps) while the training batches already agreed 0.62: more data as well as more steps. The
first block is exactly `smollm2_eagle_chat`'s data, so its work directory's `data/` can be copied in and only the
new block is generated.

    python -m sage_jax.train_draft --config configs/sage/smollm2_eagle_chat2.py --workdir runs/smollm2_eagle_chat2
"""

import ml_collections

from configs.sage import smollm2_eagle_chat


def get_config() -> ml_collections.ConfigDict:
    c = smollm2_eagle_chat.get_config()
    c.data.extra_general_seeds = (1,)
    c.eagle.train.steps = 2000
    c.eagle.train.eval_every = 500
    return c
