"""The two PGLA tables of docs/pgla.md (and the README's excerpt) from one `python -m pgla_jax.attack` results.json:
gradient cosine per denoiser (best of each row in bold) and DLG image PSNR as received / ancestral / DDIM / the
Gaussian prior's DDIM (those that were attacked), with the attack's own jitter where the run measured it
(``--jitter J``). The tables open with what produced the results (commit, command line, the denoiser checkpoints'
sha256, CPU, jax), where results.json records it (`configs.provenance`).

    .venv/bin/python benchmarks/pgla/tables.py benchmarks/pgla/results/paper_8img.json
"""

from __future__ import annotations

import argparse
import json

from configs import provenance

COLUMNS = [("none", "none"), ("gaussian_filter", "Gauss. filter"), ("wiener", "Wiener (σ known)"),
           ("dncnn", "DnCNN"), ("diffusion", "diffusion (ancestral)"), ("diffusion_ddim", "DDIM"),
           ("diffusion_oneshot", "one-shot x̂₀"), ("diffusion_conditional", "conditional"),
           ("diffusion_released", "released loop"), ("diffusion_nonadaptive", "non-adaptive"),
           ("prior", "prior (ancestral)"), ("prior_ddim", "prior DDIM"), ("prior_oneshot", "prior one-shot")]
DLG_ROWS = ("none", "diffusion", "diffusion_ddim", "prior_ddim")


def cosine_table(rows) -> str:
    cols = [c for c in COLUMNS if any(r["denoiser"] == c[0] for r in rows)]
    out = ["| noise | ε | noise std | t* | " + " | ".join(label for _, label in cols) + " |",
           "|" + "---|" * (4 + len(cols))]
    for noise, eps in dict.fromkeys((r["noise"], r["epsilon"]) for r in rows):
        by = {r["denoiser"]: r for r in rows if (r["noise"], r["epsilon"]) == (noise, eps)}
        vals = {n: float(f"{by[n]['grad_cosine']:.5f}") for n, _ in cols if n in by}
        best = max(vals.values())
        t = next((by[n]["t_star"] for n in ("diffusion_ddim", "diffusion", "prior_ddim") if n in by), None)
        cells = [f"**{vals[n]:.5f}**" if vals[n] == best else f"{vals[n]:.5f}" for n, _ in cols]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of python -m pgla_jax.attack")
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


if __name__ == "__main__":
    main()
