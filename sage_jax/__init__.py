"""SAGE: entropy-guided adaptive speculative decoding in JAX / Flax NNX.

Dimension letters, used in einsum strings, `jaxtyping` annotations and variable suffixes across the project:

    B batch            T query tokens (this forward)    S key/value (cache) positions
    D model width      N query heads                    K key/value heads
    G query heads per KV head (N = K*G)                 H head dim
    F MLP width        V vocabulary                     L layers
    W tree nodes       P image patches / visual tokens
"""
