"""Fold a SmolLM2 fidelity run (saved by ``smollm2_fidelity.py --save``) with its sink prefix and check it.

Writes the folded export, then compares on the run's held-out blocks: held-out CE of the tapered
model at g = 0 (reading BOS + text) and of the folded model (reading the text; it holds the BOS sink
as a key/value prefix), both over the same targets; and greedy generations from held-out prompts.

    python -m conversion_scripts.experiments.fold_fidelity_run --checkpoint /tmp/fid/RUN.pt --output /tmp/fid/RUN_folded
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm import export_folded, fold_model
from hf_tapernorm.evaluation import heldout_loss

from .smollm2_fidelity import load_saved_run, stdlib_blocks

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True, help="folder for the folded export")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--report", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok, config = load_saved_run(args.checkpoint)
    if int(config["sink"]) != 1:
        raise SystemExit(f"{args.checkpoint}: this check needs a run with the BOS sink (--sink 1)")
    _, held = stdlib_blocks(
        tok, 1, int(config["eval_blocks"]), int(config["seq"]), shuffle=config.get("shuffle") == "True"
    )
    folded = fold_model(model, probe=held[:2, 1:])
    export_folded(folded, args.output)
    reloaded = AutoModelForCausalLM.from_pretrained(args.output).eval()
    result = {
        "checkpoint": str(args.checkpoint),
        "fold_check": folded.fold_report.to_dict(),
        "tapered_g0": heldout_loss(model, held, batch_size=2, prefix_length=1),
        "folded": heldout_loss(reloaded, held, batch_size=2, prefix_length=1),
    }
    same = []
    with torch.no_grad():
        for row in held[: args.prompts]:
            prompt = row[1 : 1 + args.prompt_tokens][None]
            unfolded = model.generate(
                torch.cat([row[:1][None], prompt], 1), max_new_tokens=args.new_tokens, do_sample=False
            )[:, 1:]
            greedy = reloaded.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
            same.append(bool(torch.equal(unfolded, greedy)))
            result.setdefault("samples", []).append(tok.decode(greedy[0, args.prompt_tokens :]))
    result["greedy_identical"] = same
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.report:
        args.report.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
