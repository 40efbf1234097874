"""The shipped EAGLE-style head (`sage_jax/assets/smollm2_eagle`) for SmolLM2-135M-Instruct over an 8,192-id draft
vocabulary, self-distilled from the target's own greedy answers. It was made in four stages, each continuing the
last one's head; `get_config(STAGE)` (``--config smollm2_eagle:STAGE``) is each stage's recipe, the default the
last one:

- ``scratch``: from scratch on the target's greedy answers (128 new tokens) to 3,452 offline prompts, 512 from
  Python stdlib code and Python docs prose and two blocks of 1,536 chat-style WordNet prompts (the "extended"
  templates; the second block drawn with seed 1), with the features the rollout keeps; 2,000 steps of 8 rows with a
  2-level training-time test.
- ``answers4k``: that head 800 steps more (a fresh warmup and cosine schedule, lr 1e-3) on `build_datastore`'s
  greedy answers to 4,096 training-split WordNet prompts (96 new tokens), less those the first stage answered,
  teacher-forced for their features (`data.answers`); the first stage's prompts are not answered again
  (`data.rollouts=False`), its held-out block is.
- ``answers6k``: the same on the first 6,144 answers (`data.n_answers`).
- ``device`` (default): that head continued online (the target's features computed inside the step) on the
  target's greedy answers to chat prompts it wrote itself, batches of 64 rows, by two runs of
  `scripts/device/train_head.py` on an accelerator.

End to end (the first three stages on a CPU, about 3 h 40 min on 2 cores; the last on one accelerator, 11 minutes of
runs):

    python -m sage_jax.train_draft --config smollm2_eagle:scratch --workdir runs/smollm2_eagle_scratch
    python -m sage_jax.build_datastore --answers 4096 --workdir runs/datastore
    python -m sage_jax.train_draft --config smollm2_eagle:answers4k --workdir runs/smollm2_eagle_answers4k
    python -m sage_jax.build_datastore --answers 6144 --workdir runs/datastore   # resumes: 2,048 more answers
    python -m sage_jax.train_draft --config smollm2_eagle:answers6k --workdir runs/smollm2_eagle_answers6k
    # run 1, 500 s: prompts, answers and 3,066 of 6,000 cosine steps from runs/smollm2_eagle_answers6k/eagle_head
    python scripts/device/train_head.py --out OUT1 --seconds 500
    tar xf OUT1/head.tar -C OUT1
    # run 2, 180 s: the same rows, run 1's head annealed 1,100 steps from lr 3e-4
    python scripts/device/train_head.py --out OUT2 --answers OUT1/answers.jsonl.gz --init-from OUT1/eagle_head \\
        --lr 3e-4 --steps 1100 --seconds 180 --reserve 28
    tar xf OUT2/head.tar -C OUT2    # OUT2/eagle_head: the shipped head

Run 1 is bound by its deadline, not by counts: on another device it makes another number of prompts, answers and
steps. On a CPU the device stage's rows train through the shard path instead, far slower
(``python -m sage_jax.train_draft --config smollm2_eagle --set data.answers=OUT1/answers.jsonl``, decompressed).
What each stage measured: docs/drafts.md, "How the shipped head was made".
"""

import ml_collections

STAGES = ("scratch", "answers4k", "answers6k", "device")


def get_config(stage: str | None = None) -> ml_collections.ConfigDict:
    stage = stage or STAGES[-1]
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r} of smollm2_eagle; expected one of {', '.join(STAGES)}")
    c = ml_collections.ConfigDict(dict(
        kind="draft",
        target="default", kinds=("eagle",), vocab_size=8192, out_dtype="bfloat16",
        data=dict(n_train=512, n_heldout=32, n_general=1536, n_heldout_general=32, general_templates="extended",
                  extra_general_seeds=(1,), gen_batch=32, max_new_tokens=128, max_prompt_tokens=160),
        eagle=dict(train=dict(steps=2000, lr=2e-3, warmup=20, prompt_weight=0.2, head_window=129, unroll=2,
                              eval_every=500, ckpt_every=50)),
    ))
    if stage == "scratch":
        return c
    c.data.update(rollouts=False, answers="runs/datastore/answers.jsonl", n_answers=4096)
    c.eagle.init_from = "runs/smollm2_eagle_scratch/eagle_head"
    c.eagle.train.update(steps=800, lr=1e-3, warmup=20, eval_every=200, ckpt_every=50)
    if stage == "answers4k":
        return c
    c.data.n_answers = 6144
    c.eagle.init_from = "runs/smollm2_eagle_answers4k/eagle_head"
    if stage == "answers6k":
        return c
    # `scripts/device/train_head.py` writes the answers to its WORKDIR/answers.jsonl and reads `data.answers` there.
    c.data = dict(n_train=0, n_heldout=0, rollouts=False, answers="runs/device/answers.jsonl", max_new_tokens=128,
                  max_prompt_tokens=160)
    c.eagle.init_from = "runs/smollm2_eagle_answers6k/eagle_head"
    c.eagle.train.update(steps=6000, batch_size=64, lr=1e-3, warmup=50, eval_every=1000, ckpt_every=500)
    return c
