"""An EAGLE-3-style head for SmolLM2-135M-Instruct (issue 19): the inputs of target layers 2, 15 and 27 fused
(HF `hidden_states[2, 15, 27]`), no feature regression, 4-level training-time test weighted 0.8^k, hard
cross-entropy on the target's argmax beside the KL, and its own trainable final norm + LM head over an 8,192-id
vocabulary (warm-started from the target's rows).

Data: the target's greedy answers (128 new tokens) to 512 corpus + 1,024 extended chat-style WordNet prompts, and
2,048 teacher-forced rows of train-split Python docs prose and stdlib code in the assistant turn
(`sage_jax/training/features.py`); every row's tapped features, last hidden state and argmax in array_record
shards under WORKDIR/shards. The held-out prompts (`sage_jax/prompts.py`) are in none of them.

    python -m sage_jax.train_draft --config smollm2_eagle3 --workdir runs/smollm2_eagle3
"""

from sage_jax.training.recipe import DataConfig, DraftRecipe, EagleConfig, TrainConfig

TRAIN = TrainConfig(steps=800, lr=2e-3, warmup=50, prompt_weight=0.2, head_window=129, unroll=4,
                    feature_weight=0.0, hard_weight=0.5, eval_every=200, ckpt_every=100)


def get_config() -> DraftRecipe:
    return DraftRecipe(
        target="default", kinds=("eagle",), vocab_size=8192, out_dtype="bfloat16",
        data=DataConfig(n_train=512, n_heldout=32, n_general=1024, n_heldout_general=32, gen_batch=32,
                        general_templates="extended", max_new_tokens=128, max_prompt_tokens=160,
                        corpus_rows=2048, feature_batch=8),
        eagle=EagleConfig(taps=(2, 15, 27), own_head=True, train=TRAIN),
    )
