"""`smollm2_eagle_chat` with a second block of 1,536 chat-style WordNet prompts (seed 1) and twice the training.

Why: with `smollm2_eagle_chat` the held-out agreement was still rising at its last step (0.26, 0.33, 0.38, 0.41
after 250..1,000 steps) while the training batches already agreed 0.62: more data as well as more steps. The
first block is exactly `smollm2_eagle_chat`'s data, so its work directory's `data/` can be copied in and only the
new block is generated.

    python -m sage_jax.train_draft --config configs/sage/smollm2_eagle_chat2.py --workdir runs/smollm2_eagle_chat2

Shipped in `sage_jax/assets/smollm2_eagle` (2026-11-30). Measured on the 2-core CPU, with the first block's data
copied in and test runs sharing the CPU for part of the time: the new block 34 min (1,465 prompts after dropping
repeats; 3,452 training rows and 302k answer tokens in all), the head 53 min (2,000 steps of 8 rows, ~4.6 epochs).
From scratch, add the first block's ~51 min. Held-out (its own 63 rows): teacher-forced top-1 agreement 0.30,
0.37, 0.43, 0.46 after 500..2,000 steps (`smollm2_eagle_chat`: 0.41), greedy chain of 5 τ+1 2.06 (1.73). On the
24 held-out chat prompts (`python -m sage_jax.draft.evaluate --policies sage,chain --batch 5`): sage τ+1 1.74,
chain 1.51 (`smollm2_eagle_chat`: 1.65, 1.41), all 24 identical to AR.
"""

import ml_collections

from configs.sage import smollm2_eagle_chat


def get_config() -> ml_collections.ConfigDict:
    c = smollm2_eagle_chat.get_config()
    c.data.extra_general_seeds = (1,)
    c.eagle.train.steps = 2000
    c.eagle.train.eval_every = 500
    return c
