"""Drafts for speculative decoding: an EAGLE-style head, a reduced draft vocabulary, training data and training.

    from sage_jax.draft import eagle, vocab, data, train, export
"""
