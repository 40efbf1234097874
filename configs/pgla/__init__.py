"""PGLA presets as data, one module each: `get_config()` returns an `ml_collections.ConfigDict` with
``kind = "experiment"`` (`pgla_jax.config.ExperimentConfig`, for ``python -m pgla_jax.attack --config NAME``) or
``kind = "denoiser"`` (`pgla_jax.config.DenoiserConfig`, the `denoiser_*` presets, for
``python -m pgla_jax.train_denoiser --config NAME``). They reproduce the paper's settings (`mnist_lenet`,
`cifar100_lenet`, `stl10_lenet`, `denoiser_paper`), the shipped denoisers (`denoiser_lenet`, `denoiser_patches` for
the `patches_lenet` victim) and the tests' tiny ones (`digits_tiny`, `denoiser_tiny`); a preset that differs from
another in a few fields derives from it."""
