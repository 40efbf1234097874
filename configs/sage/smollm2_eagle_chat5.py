"""`smollm2_eagle_chat4`'s head trained 800 steps more on the target's greedy answers to the first 8,192
training-split WordNet prompts (chat4's 6,144 and 2,048 more, ~25 min of batched decoding on the 2-core CPU), less
those answered in chat2's data, teacher-forced for their features (`data.answers`; all 5,632 rows again, ~19 min:
rows are sorted by length, so chat4's shards hold other rows and `features.write_shards` rewrites them).

    python -m sage_jax.build_datastore --answers 8192 --workdir runs/datastore
    python -m sage_jax.train_draft --config smollm2_eagle_chat5 --workdir runs/smollm2_eagle_chat5

(after chat2 .. chat4, `smollm2_eagle_chat4`'s docstring; or `--set eagle.init_from=sage_jax/assets/smollm2_eagle`
to continue the shipped chat4 head.) Not shipped: on the bench's 32 chat prompts, SAGE + both retrieval chains at
θ = 0, 2.735 against chat4's 2.728; on the 24 held-out prompts 2.390 against 2.412 (SAGE alone 1.827 against 1.822)
(benchmarks/sage/results/heads_continued/table.md).
"""

import dataclasses

from configs.sage import smollm2_eagle_chat4
from sage_jax.training.recipe import DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle_chat4.get_config()
    return dataclasses.replace(c, data=dataclasses.replace(c.data, n_answers=8192),
                               eagle=dataclasses.replace(c.eagle, init_from="runs/smollm2_eagle_chat4/eagle_head"))
