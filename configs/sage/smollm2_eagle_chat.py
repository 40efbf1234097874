"""`smollm2_eagle` with three times its WordNet prompts, in the "extended" chat style (more phrasings; summaries,
advice and small arithmetic problems), and 1,000 training steps: 512 corpus + 1,536 chat prompts.

    python -m sage_jax.train_draft --config smollm2_eagle_chat --workdir runs/smollm2_eagle_chat
"""

import dataclasses

from configs.sage import smollm2_eagle
from sage_jax.training.recipe import DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle.get_config()
    return dataclasses.replace(
        c, data=dataclasses.replace(c.data, n_general=1536, general_templates="extended"),
        eagle=dataclasses.replace(c.eagle, train=dataclasses.replace(c.eagle.train, steps=1000, eval_every=250)))
