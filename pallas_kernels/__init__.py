"""The project's Pallas kernels, each with a pure-jnp reference that is its oracle and the path where it does not
run: tree attention and the exact mode's row-tiled matmul (Mosaic on TPU, Triton on GPU). The CPU kernels called
through XLA's FFI are in `cpu_kernels`."""
