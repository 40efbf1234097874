"""The project's kernels, each with a pure-jnp reference that is its oracle and the path where it does not run:
tree attention (Pallas: Mosaic on TPU, Triton on GPU) and the skinny matmul (a C++ XLA:CPU FFI kernel for the few
rows of a decode / verify step)."""
