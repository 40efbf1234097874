"""The two PGLA tables of docs/pgla.md (and the README's excerpt) from one `python -m pgla_jax.attack` results.json:
gradient cosine per denoiser (best of each row in bold) and DLG image PSNR as received / ancestral / DDIM / the
Gaussian prior's DDIM / with its learned correction / the attack-aware default path (those that were attacked), with
the attack's own jitter where the run measured it (``--jitter J``). The tables open with what produced the results
(commit, command line, the denoiser checkpoints' sha256, CPU, jax), where results.json records it
(`configs.provenance`). ``--full`` adds the gradient PSNR of every denoiser and, per attacked denoiser, DLG's image
PSNR, SSIM and label accuracy against the protected gradient's (± its jitter); ``--plot PNG`` draws image PSNR
against ε, one line per attacked denoiser and one panel per noise.

    .venv/bin/python benchmarks/pgla/tables.py benchmarks/pgla/results/paper_8img.json [--full] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json

from configs import provenance

COLUMNS = [("none", "none"), ("gaussian_filter", "Gauss. filter"), ("wiener", "Wiener (σ known)"),
           ("dncnn", "DnCNN"), ("diffusion", "diffusion (ancestral)"), ("diffusion_ddim", "DDIM"),
           ("diffusion_oneshot", "one-shot x̂₀"), ("diffusion_conditional", "conditional"),
           ("diffusion_released", "released loop"), ("diffusion_nonadaptive", "non-adaptive"),
           ("prior", "prior (ancestral)"), ("prior_ddim", "prior DDIM"), ("prior_oneshot", "prior one-shot"),
           ("prior_refined", "prior + learned")]
DLG_ROWS = ("none", "diffusion", "diffusion_ddim", "prior_ddim", "prior_refined", "attack_aware")
PLOT_LABELS = {"none": "protected (none)", "diffusion": "U-Net ancestral", "diffusion_ddim": "U-Net DDIM",
               "prior": "prior ancestral", "attack_aware": "attack-aware (default)"}


def cosine_table(rows, field: str = "grad_cosine", digits: int = 5) -> str:
    """One row per (noise, ε), one column per denoiser: `field` (the gradient cosine, or "grad_psnr"); best bold."""
    cols = [c for c in COLUMNS if any(r["denoiser"] == c[0] for r in rows)]
    out = ["| noise | ε | noise std | t* | " + " | ".join(label for _, label in cols) + " |",
           "|" + "---|" * (4 + len(cols))]
    for noise, eps in dict.fromkeys((r["noise"], r["epsilon"]) for r in rows):
        by = {r["denoiser"]: r for r in rows if (r["noise"], r["epsilon"]) == (noise, eps)}
        vals = {n: float(f"{by[n][field]:.{digits}f}") for n, _ in cols if n in by}
        best = max(vals.values())
        t = next((by[n]["t_star"] for n in ("diffusion_ddim", "diffusion", "prior_ddim") if n in by), None)
        cells = [f"**{vals[n]:.{digits}f}**" if vals[n] == best else f"{vals[n]:.{digits}f}" for n, _ in cols]
        out.append(f"| {noise} | {eps:g} | {by['none']['noise_std']:.3g} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def dlg_table(rows) -> str:
    eps_all = list(dict.fromkeys(r["epsilon"] for r in rows))
    out = ["| noise | " + " | ".join(f"ε = {e:g}" for e in eps_all) + " |", "|" + "---|" * (1 + len(eps_all))]
    for noise in dict.fromkeys(r["noise"] for r in rows):
        cells = []
        for eps in eps_all:
            by = {r["denoiser"]: r for r in rows if (r["noise"], r["epsilon"]) == (noise, eps)}
            vals = " / ".join(f"{by[n]['image_psnr']:.1f}" for n in DLG_ROWS
                              if n in by and by[n]["image_psnr"] is not None)
            jit = by["none"].get("image_psnr_jitter")
            cells.append(f"{vals} dB" + (f" (± {jit:.2f})" if jit is not None else ""))
        out.append(f"| {noise} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def attack_table(rows) -> str:
    """One row per (noise, ε, attacked denoiser): DLG's image PSNR / SSIM / label accuracy, and the PSNR's gain over
    the protected gradient's against that row's jitter (the attack's own spread over random starts)."""
    out = ["| noise | ε | t* | denoiser | image PSNR dB | SSIM | label acc. | vs protected (jitter) |",
           "|---|---|---|---|---|---|---|---|"]
    for noise, eps in dict.fromkeys((r["noise"], r["epsilon"]) for r in rows):
        by = {r["denoiser"]: r for r in rows if (r["noise"], r["epsilon"]) == (noise, eps)
              and r["image_psnr"] is not None}
        base, jit = by["none"]["image_psnr"], by["none"].get("image_psnr_jitter")
        for name, r in by.items():
            gain = f"{r['image_psnr'] - base:+.2f}" if name != "none" else "" if jit is None else f"± {jit:.2f}"
            shown = f"{name} (α {r['blend']:.2f})" if "blend" in r else name
            out.append(f"| {noise} | {eps:g} | {r['t_star'] if r['t_star'] is not None else ''} | {shown} | "
                       f"{r['image_psnr']:.2f} | {r['image_ssim']:.3f} | {r['label_accuracy']:.2f} | {gain} |")
    return "\n".join(out)


def plot(rows, path: str) -> str:
    """Image PSNR against ε (log axis), one line per attacked denoiser, one panel per noise kind; the protected
    gradient's line carries its jitter as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noises = list(dict.fromkeys(r["noise"] for r in rows))
    fig, axes = plt.subplots(1, len(noises), figsize=(5.2 * len(noises), 3.8), squeeze=False)
    for ax, noise in zip(axes[0], noises, strict=True):
        mine = [r for r in rows if r["noise"] == noise and r["image_psnr"] is not None]
        for name in dict.fromkeys(r["denoiser"] for r in mine):
            pts = sorted((r["epsilon"], r["image_psnr"], r.get("image_psnr_jitter")) for r in mine
                         if r["denoiser"] == name)
            eps, psnr = [p[0] for p in pts], [p[1] for p in pts]
            label = PLOT_LABELS.get(name, dict(COLUMNS).get(name, name))
            ax.plot(eps, psnr, marker="o", label=label)
            if name == "none" and all(p[2] is not None for p in pts):
                ax.fill_between(eps, [p - j for p, j in zip(psnr, [p[2] for p in pts], strict=True)],
                                [p + j for p, j in zip(psnr, [p[2] for p in pts], strict=True)], alpha=0.2)
        ax.set_xscale("log")
        ax.set_xlabel("ε")
        ax.set_ylabel("DLG image PSNR (dB)")
        ax.set_title(f"{noise} noise")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of python -m pgla_jax.attack")
    ap.add_argument("--full", action="store_true", help="also gradient PSNR and the per-denoiser attack table")
    ap.add_argument("--plot", metavar="PNG", help="write image PSNR against ε here")
    args = ap.parse_args()
    with open(args.results) as f:
        res = json.load(f)
    if "provenance" in res:
        print(provenance.markdown(res["provenance"]))
    else:
        print(f"- provenance: not recorded in {args.results} (written before results files recorded it)")
    print()
    print(cosine_table(res["results"]))
    print()
    print(f"clean gradient: {res['clean']['image_psnr']:.1f} dB")
    print(dlg_table(res["results"]))
    if args.full:
        print()
        print(cosine_table(res["results"], "grad_psnr", 2))
        print()
        print(attack_table(res["results"]))
    if args.plot:
        print(f"plot: {plot(res['results'], args.plot)}")


if __name__ == "__main__":
    main()
