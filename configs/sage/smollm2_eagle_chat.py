"""A larger, chat-heavier recipe for the SmolLM2-135M-Instruct EAGLE head (the successor of `smollm2_eagle`).

Why: the shipped head's held-out greedy chain reaches τ+1 2.10 on prompts like its training prompts but 1.50 on
the held-out chat prompts (teacher-forced chains of 5, 20 prompts each, 2026-11-30): it is off-distribution more
than it is small. This recipe doubles the prompts and makes three quarters of them chat-style WordNet prompts in
the "extended" style (more phrasings; summaries, advice and small arithmetic problems, the benchmark's other
kinds; its topics are excluded too), then trains longer.

    python -m sage_jax.train_draft --config configs/sage/smollm2_eagle_chat.py --workdir runs/smollm2_eagle_chat

Data: 512 corpus + 1,536 WordNet prompts, greedy answers of up to 128 tokens with features (~1.5 h on the 2-core
CPU; finished shards are kept, so the same command resumes). Head: 1,000 steps of 8 rows (~4 epochs).
"""

import ml_collections

from configs.sage import smollm2_eagle


def get_config() -> ml_collections.ConfigDict:
    c = smollm2_eagle.get_config()
    c.data.n_general = 1536
    c.data.general_templates = "extended"
    c.eagle.train.steps = 1000
    c.eagle.train.eval_every = 250
    return c
