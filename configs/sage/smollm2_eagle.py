"""An EAGLE-style head for SmolLM2-135M-Instruct over an 8,192-id draft vocabulary, self-distilled from the target's
own greedy answers (128 new tokens) to 1,024 offline prompts: 512 from Python stdlib code and Python docs prose and
512 chat-style WordNet prompts (963 after the length cut), with the target's features kept by the rollout; 450
steps of 8 rows with 2-level training-time test. The base of the `smollm2_eagle_chat*` recipes.

    python -m sage_jax.train_draft --config smollm2_eagle --workdir runs/smollm2_eagle
"""

from sage_jax.training.recipe import DataConfig, DraftRecipe, EagleConfig, LMDraftConfig, TrainConfig

TRAIN = TrainConfig(steps=450, lr=2e-3, warmup=20, prompt_weight=0.2, head_window=129, unroll=2, eval_every=150,
                    ckpt_every=50)


def get_config() -> DraftRecipe:
    return DraftRecipe(
        target="default", kinds=("eagle",), vocab_size=8192, out_dtype="bfloat16",
        data=DataConfig(n_train=512, n_heldout=32, n_general=512, n_heldout_general=32, gen_batch=32,
                        max_new_tokens=128, max_prompt_tokens=160),
        eagle=EagleConfig(train=TRAIN),
        # Trained only with kinds=("eagle", "lm"): a separate 2-layer LM draft.
        lm=LMDraftConfig(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=704,
                         train=TrainConfig(steps=100, lr=3e-3, warmup=20, prompt_weight=0.2, feature_weight=0.0,
                                           head_window=129, eval_every=50, ckpt_every=25)),
    )
