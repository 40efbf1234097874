"""`python -m sage_jax.bench`: our decoders side by side with transformers' on the same weights, one process."""
