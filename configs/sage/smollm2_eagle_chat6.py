"""The CPU form of `smollm2_eagle_device` (not run: that recipe made the shipped head on a lent H200 with 13 times
these answers): `smollm2_eagle_chat4`'s head trained 800 steps more on the target's greedy answers to chat prompts
it wrote itself (`build_datastore --prompts self`: user messages sampled from the chat template's empty user slot,
opening in turn with `training/self_prompts.STARTERS`, held-out prompts and their close relatives filtered out),
teacher-forced for their features (`data.answers`). Where WordNet's templates ask about random nouns, these are
the kind of requests the target was tuned on, so the data moves towards what chat users ask.

    python -m sage_jax.build_datastore --prompts self --answers 2048 --batch 64 --max-new-tokens 128 \\
        --workdir runs/self_prompts
    python -m sage_jax.train_draft --config smollm2_eagle_chat6 --workdir runs/smollm2_eagle_chat6

(the first step: ~25 min to sample the prompts and ~25 min to answer them on the 2-core CPU; the second continues
chat4's head, `eagle.init_from`, and answers chat2's held-out block for its held-out rows.)
"""

import dataclasses

from configs.sage import smollm2_eagle_chat4
from sage_jax.training.recipe import DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle_chat4.get_config()
    return dataclasses.replace(c, data=dataclasses.replace(c.data, answers="runs/self_prompts/answers.jsonl",
                                                           n_answers=2048),
                               eagle=dataclasses.replace(c.eagle, init_from="runs/smollm2_eagle_chat4/eagle_head"))
