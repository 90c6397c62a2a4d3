#!/usr/bin/env python
"""How a broken block breaks, layer by layer: the sink's and the largest content token's residual, and the
sink's share of attention, in a finished run's tapered model and its baseline.

The sink's massive activation is made by a few MLPs of the normalized model; a content token that reaches the
same activation outbids the sink for attention wherever the attention input is linear. The table shows, per
layer, the residual RMS after it of the sink, of the median content token and of one content token
(``--position``, by default the one whose residual most exceeds the baseline's at some layer), the RMS of the
attention and MLP updates that layer adds to that token, and each model's mean share of attention on the
sink, in both models. The tapered checkpoint computes what the export computes (the report's fold check) and,
unlike the export, which holds the sink as a cache prefix, returns the sink's position too::

    python -m conversion_scripts.experiments.sink_takeover runs/fidelity/steps600/default/seed42 --block 207
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tapernorm.evaluation import sink_shares
from hf_tapernorm.training import load_tapered

from .scan_runs import reference_of, text_set


def rms(x: torch.Tensor) -> torch.Tensor:
    return x.double().pow(2).mean(-1).sqrt()


@torch.no_grad()
def residuals(
    model: torch.nn.Module, ids: torch.Tensor, prefix_length: int = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """``[layers, positions]``: every position's residual RMS after each layer but the last (transformers returns
    the last layer's output through the final norm); ``{"attention", "mlp"}``: ``[layers, positions]``, the
    RMS of each layer's two updates; and the block's cross-entropy on the targets after the first one that follows
    the ``prefix_length`` sink tokens, as the report's broken-block check reads it."""
    updates: dict[str, list[torch.Tensor]] = {"attention": [], "mlp": []}
    handles = []
    for layer in model.model.layers:
        for key, part in (("attention", layer.self_attn), ("mlp", layer.mlp)):
            handles.append(
                part.register_forward_hook(
                    lambda m, a, o, key=key: updates[key].append(rms((o[0] if isinstance(o, tuple) else o)[0]))
                )
            )
    try:
        output = model(input_ids=ids, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    log_probs = output.logits[0, prefix_length:-1].double().log_softmax(-1)
    cross_entropy = float(-log_probs.gather(-1, ids[0, prefix_length + 1 :, None]).mean())
    hidden = output.hidden_states[1:-1]
    return torch.stack([rms(h[0]) for h in hidden]), {k: torch.stack(v) for k, v in updates.items()}, cross_entropy


def trace(
    tapered: torch.nn.Module,
    baseline: torch.nn.Module,
    ids: torch.Tensor,
    position: Optional[int],
    prefix_length: int = 1,
) -> dict:
    (mine, my_updates, my_loss), (theirs, their_updates, their_loss) = (
        residuals(tapered, ids, prefix_length),
        residuals(baseline, ids, prefix_length),
    )
    if position is None:  # the content token whose residual grew most over the baseline's, at any layer
        position = int((mine[:, 1:] / theirs[:, 1:]).max(0).values.argmax()) + 1
    shares = sink_shares(tapered, ids), sink_shares(baseline, ids)
    rows = []
    for layer in range(mine.shape[0]):
        rows.append(
            {
                "layer": layer,
                "sink": [float(mine[layer, 0]), float(theirs[layer, 0])],
                "median": [float(mine[layer, 1:].median()), float(theirs[layer, 1:].median())],
                "token": [float(mine[layer, position]), float(theirs[layer, position])],
                "attention_update": [
                    float(my_updates["attention"][layer, position]),
                    float(their_updates["attention"][layer, position]),
                ],
                "mlp_update": [float(my_updates["mlp"][layer, position]), float(their_updates["mlp"][layer, position])],
                "sink_share": [shares[0][layer], shares[1][layer]] if len(shares[0]) > layer else None,
            }
        )
    return {"position": position, "cross_entropy": [my_loss, their_loss], "layers": rows}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="A finished taper run folder (tapered/, report.json, a baseline).")
    parser.add_argument("--block", type=int, required=True, help="An out-of-corpus block of the run's report.")
    parser.add_argument("--position", type=int, default=None, help="The content token to follow (the grown one).")
    parser.add_argument("--output", type=Path, default=None, help="JSON of the trace (<run>/sink_takeover.json).")
    args = parser.parse_args(argv)
    report: dict[str, Any] = json.loads((args.run / "report.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.run / "folded")
    name = "out-of-corpus"
    sink = report["taper"]["sink_token_ids"] or []
    ooc = text_set(report, tokenizer, name, report["evaluation_sets"][name]["blocks"], sink)
    ids = ooc.blocks[args.block : args.block + 1]
    tapered = load_tapered(args.run / "tapered").eval()
    baseline = AutoModelForCausalLM.from_pretrained(reference_of(args.run, report)).eval()
    result = trace(tapered, baseline, ids, args.position, len(sink))
    result["token_text"] = tokenizer.decode(ids[0, result["position"] : result["position"] + 1])
    print(f"block {args.block}: {tokenizer.decode(ids[0, :24])!r}")
    loss, reference_loss = result["cross_entropy"]
    print(
        f"cross-entropy: tapered {loss:.3f} / baseline {reference_loss:.3f} "
        f"({loss - reference_loss:+.3f} nats per token)"
    )
    print(f"content token at position {result['position']}: {result['token_text']!r} (tapered / baseline)")
    print("layer | sink RMS | median RMS | token RMS | its attention update | its MLP update | sink's share")
    for row in result["layers"]:
        keys = ("sink", "median", "token", "attention_update", "mlp_update")
        pairs = [f"{row[k][0]:7.1f} / {row[k][1]:<7.1f}" for k in keys]
        share = "" if row["sink_share"] is None else f"{row['sink_share'][0]:.3f} / {row['sink_share'][1]:.3f}"
        print(f"{row['layer']:5d} | " + " | ".join(pairs) + f" | {share}")
    (args.output or args.run / "sink_takeover.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
