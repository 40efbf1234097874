"""SAGE draft recipes: one module per recipe, each with `get_config() -> sage_jax.training.recipe.DraftRecipe`."""
