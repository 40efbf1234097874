"""SAGE recipes as data, one module each: `get_config()` returns an `ml_collections.ConfigDict` whose `kind` says
what it describes, validated by the consuming package: ``"draft"`` (`sage_jax.training.recipe.DraftRecipe`, for
``python -m sage_jax.train_draft``: `tiny`, the tests' smoke recipe, and `smollm2_eagle`, the shipped head's stages),
``"vlm"`` (`sage_jax.training.vlm_recipe.VLMRecipe`, ``python -m sage_jax.train_vlm``: `smollm2_vlm`, the shipped
VLM) and ``"paper_targets"`` (`sage_jax.io.paper_targets`: the paper's 72B / 7B pairs on TPU slices)."""
