"""Training drafts for speculative decoding by self-distillation from the target (`python -m sage_jax.train_draft`).

    recipe    the frozen configs of a recipe (`configs/sage/*.py`)
    data      offline prompts (Python sources and docs) and the dataset arrays, served through grain
    wordnet   chat-style prompts about WordNet topics
    rollout   the target's batched greedy answers with its features (one compiled decode)
    train     losses, training-time test, resumable Orbax training of an EAGLE-style head or a small LM
    distillation  the whole recipe: target -> data -> drafts -> checkpoints
"""
