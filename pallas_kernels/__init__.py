"""Pallas kernels (tree attention), each with a pure-jnp reference that is also the CPU path."""
