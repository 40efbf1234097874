"""Where a draft pays on the home-trained VLM: AR against SAGE with the separate draft VLM and with the EAGLE-style
head, full trees and `--budget auto`, in one process, and the cost model's projection of the same acceptance.

    python benchmarks/sage/vlm_drafts.py [--prompts 32] [--max-new-tokens 16] [--rounds 2] [--chip v6e] [--clips]
                                         [--out benchmarks/sage/results/vlm_drafts]

One copy of the shipped VLM serves both engines (`load_engine` with the loaded `VisionLM`); each draft sees the
images pruned at the engine's default ratio (0.8; a clip's video tokens 0.9). Every method compiles on the first
prompt (timed apart), then answers the held-out Fashion-MNIST test images (`bench.vlm.heldout_images`; with
`--clips` the held-out clips, `vlm_data.heldout_clips`, asked which items appear); tokens/s count the prefill, most
of a short VLM answer's time. The methods run in `--rounds` rounds, the order reversed each round, so that a noisy
machine affects them alike; each round's ratio to its own AR is reported and the table gives the median.

The projection (`sage_jax.decoding.cost_model`, bf16 weights and caches on one `--chip`): for each draft, the
budget `--budget auto` would take there from the draft's acceptance (images: its record, `acceptance.json`, full SAGE
trees on 32 dev images; clips, which have no record: the full trees' acceptance measured here, on the same
clips), its tokens per step and the speed-up over plain decoding;
and the same acceptance on the paper's Qwen2.5-VL-72B + 7B pair on 8 chips (`lowering --project`).
Every output is checked identical to AR's. Writes OUT/vlm_drafts.json (with what produced it) and OUT/vlm_drafts.md
(with `--clips`: OUT/vlm_drafts_clips.json and .md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from configs import provenance  # noqa: E402


def acceptance_of(engine, policy: str = "sage"):
    """The draft's acceptance record for `policy`'s full trees (its `acceptance.json`, written by `evaluate_draft
    --vlm --write-prior`; the shipped ones on 32 dev images)."""
    from sage_jax.decoding.budget import AcceptanceStats

    prior = engine.acceptance_prior.get(policy)
    if prior is None:
        raise SystemExit(f"{engine.description} has no acceptance record for {policy}: run evaluate_draft --vlm "
                         f"--draft ... --write-prior first")
    return AcceptanceStats.from_json(prior)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chip", default="v6e")
    ap.add_argument("--out", default="benchmarks/sage/results/vlm_drafts")
    ap.add_argument("--clips", action="store_true", help="held-out clips instead of held-out images")
    args = ap.parse_args(argv)

    from sage_jax.bench.vlm import _measure, heldout_images, heldout_questions
    from sage_jax.decoding import cost_model
    from sage_jax.engine import load_engine
    from sage_jax.io import loader, paper_targets

    record = provenance.record("python benchmarks/sage/vlm_drafts.py", argv,
                               {"draft_vlm": loader.DEFAULT_VLM_DRAFT, "eagle_head": loader.vlm_head_draft()})
    vlm = loader.load_vision_serving(loader.default_vlm())
    engines = {"draft VLM": load_engine(vlm, loader.DEFAULT_VLM_DRAFT), "EAGLE head": load_engine(vlm,
                                                                                                loader.vlm_head_draft())}
    from sage_jax.training import vlm_data

    if args.clips:
        clips, labels = vlm_data.heldout_clips(args.prompts)
        prompts = [(vlm_data.VIDEO_QUESTION, [], [v]) for v in clips]
    else:
        images, labels = heldout_images(args.prompts)
        questions = heldout_questions()
        prompts = [(questions[i % len(questions)], [im], []) for i, im in enumerate(images)]
    from sage_jax.decoding.budget import AcceptanceStats
    from sage_jax.decoding.policies import TreePolicy

    full = TreePolicy.sage()  # what policy "sage" with no budget runs: the full tree
    measured = {d: AcceptanceStats(full.n_max, full.d_cap) for d in engines}
    methods = [("AR", "draft VLM", "ar", None)] + [(f"SAGE {b}, {d}", d, "sage", b) for d in engines
                                                    for b in ("static", "auto")]
    rounds = []
    for r in range(args.rounds):
        order = methods if r % 2 == 0 else methods[::-1]
        rounds.append({name: _measure(engines[d], prompts, pol, "auto" if budget == "auto" else None,
                                      args.max_new_tokens, acceptance=measured[d] if r == 0 and budget == "static"
                                      else None) for name, d, pol, budget in order})
    ar_tokens = [x["tokens"] for x in rounds[0]["AR"]["runs"]]
    rows = []
    for name, d, pol, budget in methods:
        per = [rd[name] for rd in rounds]
        same = all([x["tokens"] for x in m["runs"]] == ar_tokens for m in per)
        rows.append({"method": name, "draft": None if pol == "ar" else d, "budget": budget,
                     "tokens_per_second": statistics.median(m["tokens_per_second"] for m in per),
                     "vs_ar": statistics.median(m["tokens_per_second"] / rd["AR"]["tokens_per_second"]
                                                for m, rd in zip(per, rounds, strict=True)),
                     "vs_ar_per_round": [m["tokens_per_second"] / rd["AR"]["tokens_per_second"]
                                         for m, rd in zip(per, rounds, strict=True)],
                     "tau_plus_1": per[0]["tau_plus_1"], "same_as_ar": same})
    chip = cost_model.published()[args.chip]
    preset = paper_targets.presets()["qwen2.5-vl-72b+7b"]
    proj = []
    for d, eng in engines.items():
        acc = measured[d] if args.clips else acceptance_of(eng)
        target, draft = eng.cost_arches("bfloat16")
        ar_s = cost_model.forward_cost(target, 1, chip).seconds
        chosen, per_step, tok_s = cost_model.auto_choice(target, draft, chip, acc)
        paper = cost_model.project(preset, chip, tp=8, acceptance=acc)
        proj.append({"draft": d, "chip": chip.name, "home_budget": list(chosen), "home_tokens_per_step": per_step,
                     "home_speedup": tok_s * ar_s, "paper_pair": preset.name, "paper_budget": list(paper.chosen),
                     "paper_tokens_per_step": paper.chosen_tokens_per_step,
                     "paper_speedup": paper.chosen_tok_s / paper.ar_tok_s})
    out = {"provenance": record, "machine": provenance.machine(record), "prompts": args.prompts,
           "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "methods": rows, "projection": proj}
    texts = [engines["draft VLM"].tokenizer.decode(t, skip_special_tokens=True) for t in ar_tokens]
    if args.clips:
        out["right"] = sum(vlm_data.classes_named(t) == {int(k) for k in y} for t, y in zip(texts, labels, strict=True))
        what, named = "held-out clips", "name exactly the clip's items"
    else:
        out["right"] = sum(vlm_data.class_named(t) == int(y) for t, y in zip(texts, labels, strict=True))
        what, named = "held-out images", "name the right class"
    md = [f"# Drafts of the home-trained VLM: {args.prompts} {what}, {args.max_new_tokens} new tokens", "",
          provenance.markdown(record), "", f"{out['machine']}; {args.rounds} rounds (median ratio to AR); the "
          f"answers {named} for {out['right']} of {args.prompts}", "",
          "| method | tok/s (prefill included) | vs AR | per round | τ+1 | same as AR |", "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['tokens_per_second']:.1f} | {r['vs_ar']:.2f}x | "
           f"{', '.join(f'{x:.2f}' for x in r['vs_ar_per_round'])} | {r['tau_plus_1']:.2f} | "
           f"{'yes' if r['same_as_ar'] else 'NO'} |" for r in rows]
    source = "the full trees' acceptance on these clips" if args.clips else "the draft's acceptance record"
    md += ["", f"Projected on {chip.name} (cost model, bf16), `--budget auto` at {source}:", "",
           "| draft | home pair: budget | tokens/step | vs AR | Qwen2.5-VL-72B+7B on 8 chips: budget | tokens/step "
           "| vs AR |", "|---|---|---|---|---|---|---|"]
    md += [f"| {p['draft']} | {tuple(p['home_budget'])} | {p['home_tokens_per_step']:.2f} | {p['home_speedup']:.2f}x"
           f" | {tuple(p['paper_budget'])} | {p['paper_tokens_per_step']:.2f} | {p['paper_speedup']:.2f}x |"
           for p in proj]
    os.makedirs(args.out, exist_ok=True)
    name = "vlm_drafts_clips" if args.clips else "vlm_drafts"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["same_as_ar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
