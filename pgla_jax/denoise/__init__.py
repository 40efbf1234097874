"""The gradient diffusion denoiser (PGLA part 2): U-Net, DDPM maths, adaptive samplers, baselines, training."""
