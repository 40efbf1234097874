"""Decoding: sampling, tree policies, verification, the speculative loop and the autoregressive baseline."""
