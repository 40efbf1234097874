"""PGLA: perturbation-resilient gradient leakage (diffusion denoising of DP-protected gradients) in JAX.

Part 1, the attack side (importable on its own; nothing heavy is imported here)::

    import jax, jax.numpy as jnp
    from pgla_jax import data, fl, metrics, protections
    from pgla_jax.inversion import dlg
    from pgla_jax.config import AttackConfig, ProtectionConfig, VictimConfig
    from pgla_jax.models import split_victim

    x, y = data.pick(data.load_mnist5k(), 1)                      # one real MNIST digit, [0, 1] NHWC
    graphdef, params = split_victim(VictimConfig())              # DLG LeNet, U(-0.5, 0.5) init
    y1 = fl.one_hot(jnp.asarray(y), 10)
    g = fl.batch_grad(graphdef, params, jnp.asarray(x), y1)      # what a FedSGD client sends
    cfg = ProtectionConfig(noise="gaussian", calibration="paper")
    plan = protections.plan(cfg, epsilon=10.0, batch=1)         # the noise the client adds (σ from ε)
    g_dp = protections.protected_grad(graphdef, params, jnp.asarray(x), y1, jax.random.key(0), cfg=cfg,
                                      noise_plan=plan)
    rec = dlg.dlg(graphdef, params, g_dp, jax.random.key(1), cfg=AttackConfig(), batch=1, num_classes=10,
                  image_shape=(28, 28, 1))
    print(metrics.psnr(rec.images, x, data_range=1.0), rec.labels)

Part 2, the gradient diffusion denoiser (`pgla_jax.denoise`)::

    from pgla_jax.codec import make_codec
    from pgla_jax.denoise import denoisers, denoiser_checkpoint

    # the U-Net, DnCNN, Gaussian prior and closed-form baselines
    dens = denoisers.load(denoiser_checkpoint.shipped_path(), make_codec(params, "image2d", 4))
    plan1 = protections.plan(cfg, epsilon=1.0, batch=1)          # ε = 10 is below the model's first step (t* = 0)
    g_dp1 = protections.protected_grad(graphdef, params, jnp.asarray(x), y1, jax.random.key(0), cfg=cfg,
                                       noise_plan=plan1)
    g_hat, t_star = dens.run("diffusion_ddim", g_dp1, plan1, jax.random.key(2))   # σ_eff → t* = 24, √n·g', DDIM
    g_hat, t_star = dens.run("prior_ddim", g_dp1, plan1, jax.random.key(2))       # the Gaussian prior's ε instead

Command lines: ``python -m pgla_jax.attack --config mnist_lenet --images 4 --out runs/mnist`` (the shipped denoiser by
default) and ``python -m pgla_jax.train_denoiser --config denoiser_lenet --workdir runs/denoiser_lenet``; see
docs/pgla.md.
"""
