"""Host-CPU kernels, compiled for this machine and called through XLA's FFI (`jax.ffi`): the skinny matmul (C++,
for the few float32 rows of a decode / verify step). Each has a pure-jnp reference that is its oracle and the path
wherever it does not run (TPU, GPU, exported programs)."""
