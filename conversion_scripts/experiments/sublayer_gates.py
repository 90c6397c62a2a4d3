"""Which sublayers can lose their norm without training: held-out CE of SmolLM2 with the norms that feed
attention (input_layernorm) and those that feed the MLP (post_attention_layernorm) at separate gates.

A pre-norm sublayer's output, for a token whose residual is k times the typical scale, grows like k^0 for
attention (the update is a mix of the other tokens' values) but like k^2 for a SwiGLU MLP (gate x up) once
its input is no longer normalized; this probe measures what that means for the loss, right after the
calibration fit and before any training.

    python -m conversion_scripts.experiments.sublayer_gates
    python -m conversion_scripts.experiments.sublayer_gates --per-layer --eval-blocks 8

``--per-layer``: instead of the grid, one MLP norm at a time at g = 0 (every other norm at 1).
"""

from __future__ import annotations

import argparse
import json

import torch

from conversion_scripts.experiments.research.linear_fit import fit_linear_branch
from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm.config import sink_token_id
from hf_tapernorm.layers import set_sink_tokens, tapered_norms

from .smollm2_fidelity import HERE, held_out_ce, load_smollm2, stdlib_blocks

GRID = [(1.0, 1.0), (0.5, 1.0), (0.0, 1.0), (1.0, 0.5), (1.0, 0.0), (0.5, 0.5), (0.0, 0.0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--per-layer", action="store_true", help="one MLP norm at a time at g = 0")
    p.add_argument("--output", default=None, help="default: reports/sublayer_gates.json (per layer: _per_layer)")
    args = p.parse_args()
    output = args.output or HERE / "reports" / f"sublayer_gates{'_per_layer' if args.per_layer else ''}.json"
    torch.set_num_threads(1)
    model, tok = load_smollm2()
    train, held = stdlib_blocks(tok, 8, args.eval_blocks, 128, shuffle=True)
    patch_model(model, TaperNormConfig.paper())
    set_sink_tokens(model, [sink_token_id(tok)])
    fit_linear_branch(model, [train[i : i + 2] for i in range(0, 8, 2)], trim=None, per_channel=True)
    rows = [{"reference": "every norm at g = 1", "held_out_ce": held_out_ce(model, held, 2)}]
    if args.per_layer:
        for name, layer in tapered_norms(model):
            if name.endswith("post_attention_layernorm"):
                layer.set_gate(0.0)
                rows.append({"norm_at_gate_0": name, "held_out_ce": held_out_ce(model, held, 2)})
                layer.set_gate(1.0)
                print(rows[-1], flush=True)
    for attention, mlp in [] if args.per_layer else GRID:
        for name, layer in tapered_norms(model):
            layer.set_gate(mlp if name.endswith("post_attention_layernorm") else attention)
        ce = held_out_ce(model, held, 2)
        rows.append({"attention_gate": attention, "mlp_gate": mlp, "held_out_ce": ce})
        print(f"attention norms g={attention:.1f}  MLP norms g={mlp:.1f}  held-out CE {ce:.4f}", flush=True)
    with open(output, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
