"""PGLA experiment configs: one module per experiment, each with `get_config() -> pgla_jax.config.ExperimentConfig`."""
