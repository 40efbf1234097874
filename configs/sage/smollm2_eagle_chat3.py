"""The start of the shipped head (`smollm2_eagle_chat4`):
`smollm2_eagle_chat2`'s head trained 800 steps more on new data that cost no decoding of its
own, the target's greedy answers that `build_datastore` made for the shipped datastore (4,096 training-split WordNet
prompts, 96 new tokens). Answers to prompts already in chat2's data are dropped (1,901), the other 2,195 (157k answer
tokens) are teacher-forced for their features (`data.answers`; ~10 min on the 2-core CPU), and the head continues
from chat2's (`eagle.init_from`) under a fresh warmup and cosine schedule. chat2's own prompts are not answered again
(`data.rollouts=False`); its held-out block is.

    python -m sage_jax.build_datastore --answers 4096 --workdir runs/datastore
    python -m sage_jax.train_draft --config smollm2_eagle_chat2 --workdir runs/smollm2_eagle_chat2
    python -m sage_jax.train_draft --config smollm2_eagle_chat3 --workdir runs/smollm2_eagle_chat3

(the second step can be skipped by `--set eagle.init_from=` a copy of the chat2 head, e.g. the shipped head of a
checkout before this recipe.)
"""

import dataclasses

from configs.sage import smollm2_eagle_chat2
from sage_jax.training.recipe import DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle_chat2.get_config()
    return dataclasses.replace(
        c, data=dataclasses.replace(c.data, rollouts=False, answers="runs/datastore/answers.jsonl",
                                        n_answers=4096),
        eagle=dataclasses.replace(c.eagle, init_from="runs/smollm2_eagle_chat2/eagle_head", train=dataclasses.replace(
            c.eagle.train, steps=800, lr=1e-3, warmup=20, eval_every=200, ckpt_every=50)))
