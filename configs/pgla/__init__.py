"""PGLA configs, one module each with `get_config()`: an `ExperimentConfig` for `python -m pgla_jax.attack --config
NAME` or a `DenoiserConfig` (`denoiser_*`) for `python -m pgla_jax.train_denoiser --config NAME`."""
