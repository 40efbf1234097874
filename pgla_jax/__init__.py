"""PGLA: perturbation-resilient gradient leakage (diffusion denoising of DP-protected gradients) in JAX."""
