"""Where a tapering run blew up: per tapered layer, the largest non-sink token's RMS over the median token.

Loads a model saved by ``smollm2_fidelity.py --save`` (the weights and gates of the step before the
divergence), replays the training batch of ``--step`` and prints/writes, per layer, the max/median
ratio and the position of that token. A token whose ratio squares from layer to layer is running away
through the SwiGLU MLP (its output grows about as the square of its input once no norm bounds it).

    python -m conversion_scripts.experiments.runaway_trace --checkpoint /tmp/fid/s300_plain.pt --step 167
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from conversion_scripts.experiments.research.diagnostics import _per_layer_inputs
from hf_tapernorm.layers import tapered_norms

from .smollm2_fidelity import load_saved_run, stdlib_blocks

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--step", type=int, required=True, help="the training step whose batch diverged")
    p.add_argument("--output", type=Path, default=HERE / "reports" / "runaway_trace.json")
    args = p.parse_args()
    model, tok, config = load_saved_run(args.checkpoint)
    batch, seq, sink = int(config["batch"]), int(config["seq"]), int(config["sink"])
    train, _ = stdlib_blocks(tok, int(config["steps"]) * batch, 1, seq, shuffle=config.get("shuffle") == "True")
    x = train[(args.step - 1) * batch : args.step * batch]

    def ratio(layer, h):
        r = h.pow(2).mean(-1).sqrt()[:, sink:].reshape(-1)
        top = int(r.argmax())
        return float(r[top] / r.median()), divmod(top, seq - sink)

    rows = {name: parts[0] for name, parts in _per_layer_inputs(model, [x], ratio).items()}
    gate = float(next(tapered_norms(model))[1].gate)
    with torch.no_grad():
        loss = float(model.eval()(input_ids=x, labels=x).loss)
    result = {
        "checkpoint": str(args.checkpoint),
        "step": args.step,
        "gate": gate,
        "loss": loss,
        "layers": {
            name: {"max_over_median": value, "row": where[0], "position": where[1] + sink}
            for name, (value, where) in rows.items()
        },
    }
    for name, row in result["layers"].items():
        token = tok.decode([int(x[row["row"], row["position"]])])
        row["token"] = token
        print(f"{name:40s} {row['max_over_median']:12.4g}  row {row['row']} pos {row['position']} {token!r}")
    print(f"gate {gate:.4f}, loss {loss}")
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
