"""Training drafts for speculative decoding by self-distillation from the target (`python -m sage_jax.train_draft`),
and the home-trained VLM (`python -m sage_jax.train_vlm`).

    recipe        the frozen configs of a draft recipe (`configs/sage/*.py`)
    data          offline prompts (Python sources and docs) and the dataset arrays, served through grain
    wordnet       chat-style prompts about WordNet topics
    self_prompts  chat prompts the target writes itself
    answers       the target's answers to training prompts (answers.jsonl)
    rollout       the target's batched greedy answers with its features (one compiled decode)
    features      the target's teacher-forced features in array_record shards
    online        the target's features computed inside the training step
    objectives    the distillation losses (EAGLE head, training-time test, LM draft), agreement, chain acceptance
    loop          the one training loop (Orbax checkpoints, exact resume, deadline), and draft distillation on it
    distillation  the whole draft recipe: target -> data -> drafts -> checkpoints
    vlm_recipe    the frozen config of the home-trained VLM
    vlm_data      its image question / answer data
    vlm_model     its pieces around the weights (config, tokenizer, pixels)
    vlm_stages    its tower and align stages, evaluation and export
    vlm_head      a draft of it: the shipped head fine-tuned on the VLM's answers
    vlm_draft     the separate draft VLM: the target's first tower and LM layers distilled on its answers
"""
