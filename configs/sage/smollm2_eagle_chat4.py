"""The shipped head (`sage_jax/assets/smollm2_eagle`, since 2026-12-03):
`smollm2_eagle_chat3`'s head trained 800 steps more on twice its new data: `build_datastore`'s greedy answers to
the first 6,144 training-split WordNet prompts (the shipped datastore's 4,096 and 2,048 more, ~25 min of batched
decoding on the 2-core CPU), less the 1,901+ answered in chat2's data, teacher-forced for their features
(`data.answers`). The head continues from chat3's (`eagle.init_from`) under a fresh warmup and cosine schedule.

    python -m sage_jax.build_datastore --answers 6144 --workdir runs/datastore
    python -m sage_jax.train_draft --config smollm2_eagle_chat2 --workdir runs/smollm2_eagle_chat2
    python -m sage_jax.train_draft --config smollm2_eagle_chat3 --workdir runs/smollm2_eagle_chat3
    python -m sage_jax.train_draft --config smollm2_eagle_chat4 --workdir runs/smollm2_eagle_chat4

(`build_datastore` resumes, so the answers made for chat3 are kept; chat3 reads only the first 4,096,
`data.n_answers`.) Decoded on the 24 held-out chat prompts: SAGE τ+1 1.82, 2.41 with both retrieval chains at
θ = 0 (chat3: 1.80, 2.37; docs/drafts.md).
"""

import dataclasses

from configs.sage import smollm2_eagle_chat3
from sage_jax.training.recipe import DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle_chat3.get_config()
    return dataclasses.replace(c, data=dataclasses.replace(c.data, n_answers=6144),
                               eagle=dataclasses.replace(c.eagle, init_from="runs/smollm2_eagle_chat3/eagle_head"))
