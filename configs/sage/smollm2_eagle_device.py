"""The shipped head (`sage_jax/assets/smollm2_eagle`, since 2026-12-04), trained on a lent H200 in two prepared runs
of `scripts/device/train_head.py`: `smollm2_eagle_chat4`'s head continued on the target's greedy answers (128 new
tokens) to chat prompts the target wrote itself (`build_datastore --prompts self`'s sampler, batches of 512),
trained online (the target's features computed inside the step, `training/online.py`) with chat4's objective: KL on
the answer window, feature regression λ 0.1, 2-level training-time test; batches of 64 rows instead of 8.

    # run 1, 500 s: 80,203 prompts, 26,112 answers (25,856 training rows, 2.69M answer tokens), 3,066 steps
    python scripts/device/train_head.py --out OUT1 --init-from runs/smollm2_eagle_chat4/eagle_head --seconds 500
    # run 2, 180 s: the same rows, run 1's head annealed 1,100 steps from lr 3e-4
    python scripts/device/train_head.py --out OUT2 --answers OUT1/answers.jsonl.gz --init-from OUT1/eagle_head \\
        --lr 3e-4 --steps 1100 --seconds 180 --reserve 28

(OUTn/eagle_head: `tar xf OUTn/head.tar -C OUTn`. chat4's head is `python -m sage_jax.train_draft --config
smollm2_eagle_chat4`'s, or the shipped head of a checkout before this recipe: `git archive 8f8f2c5
sage_jax/assets/smollm2_eagle | tar x -C runs/chat4`.) Run 1 is bound by its deadline, not by counts: on another
device it makes another number of prompts, answers and steps (its cosine schedule of 6,000 steps was cut at 3,066,
which is why run 2 anneals). Measured in docs/drafts.md and benchmarks/sage/results/device_head/.

`data.answers` is where the script writes the answers (WORKDIR/answers.jsonl); on a CPU the same rows train through
the shard path (`python -m sage_jax.train_draft --config smollm2_eagle_device --set data.answers=...`), far slower.
"""

import dataclasses

from configs.sage import smollm2_eagle_chat4
from sage_jax.training.recipe import DataConfig, DraftRecipe


def get_config() -> DraftRecipe:
    c = smollm2_eagle_chat4.get_config()
    return dataclasses.replace(
        c, data=DataConfig(n_train=0, n_heldout=0, rollouts=False, answers="runs/device/answers.jsonl",
                           max_new_tokens=128, max_prompt_tokens=160),
        eagle=dataclasses.replace(c.eagle, init_from="runs/smollm2_eagle_chat4/eagle_head", train=dataclasses.replace(
            c.eagle.train, steps=6000, batch_size=64, lr=1e-3, warmup=50, eval_every=1000, ckpt_every=500)))
