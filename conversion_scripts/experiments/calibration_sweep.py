"""Training-free ranking of calibration options on SmolLM2-135M-Instruct: held-out CE vs gate.

For each fit (scalar or per-channel, all tokens or typical tokens only, sink kept normalized or
not) the internal norms are calibrated on a few training blocks and the gate is lowered WITHOUT
training; the CE at each gate shows how far each linear branch is from its norm where it matters.
Also records, once, the per-layer residual scale by position and each fit's branch distance.
Writes reports/calibration_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

from conversion_scripts.experiments.research.diagnostics import branch_distance, residual_scale_by_position
from conversion_scripts.experiments.research.linear_fit import fit_linear_branch
from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm.layers import tapered_norms

from .smollm2_fidelity import HERE, held_out_ce, load_smollm2, stdlib_blocks

FITS = {  # name: (sink, trim, per_channel, sequential, first tapered decoder layer)
    "paper_ls": (0, None, False, False, 0),
    "sink_ls": (1, None, False, False, 0),
    "sink_trim4": (1, 4.0, False, False, 0),
    "sink_pc_all": (1, None, True, False, 0),
    "sink_pc_trim4": (1, 4.0, True, False, 0),
    "sink_pc_all_seq": (1, None, True, True, 0),
    "sink_pc_all_late12": (1, None, True, False, 12),
    "sink_pc_all_seq_late12": (1, None, True, True, 12),
}


def set_partial_gate(model, gate: float, first_layer: int) -> None:
    """Lower the gate of the norms in decoder layers >= first_layer only (a staged taper)."""
    for name, layer in tapered_norms(model):
        if int(name.split(".layers.")[1].split(".")[0]) >= first_layer:
            layer.set_gate(gate)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gates", type=float, nargs="+", default=[0.98, 0.9, 0.7, 0.5, 0.0])
    p.add_argument("--eval-blocks", type=int, default=8)
    p.add_argument("--calib-blocks", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--fits", nargs="+", default=list(FITS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default="calibration_sweep.json")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    train, held = stdlib_blocks(tok, args.calib_blocks, args.eval_blocks, args.seq)
    print("bos", tok.bos_token_id, repr(tok.bos_token), "eos", tok.eos_token_id, repr(tok.eos_token), flush=True)
    report = {"config": vars(args), "ce_gate1": held_out_ce(model, held, 4)}
    patch_model(model, TaperNormConfig.paper())
    report["residual_scale"] = residual_scale_by_position(model, [held[:4], held[4:8]], sink_tokens=1)
    print(json.dumps(report["residual_scale"])[:3000], flush=True)
    out = HERE / "reports" / args.output
    for name in args.fits:
        sink, trim, pc, sequential, first_layer = FITS[name]
        model = load_smollm2()[0] if name != args.fits[0] else model
        if not any(True for _ in tapered_norms(model)):
            patch_model(model, TaperNormConfig.paper())
        for _, layer in tapered_norms(model):
            layer.sink_tokens = sink
        cs = fit_linear_branch(
            model, [train[i : i + 4] for i in range(0, len(train), 4)], trim=trim, per_channel=pc, sequential=sequential
        )
        row = {"c": cs, "branch_distance": branch_distance(model, [held[:4]], sink_tokens=sink)}
        for gate in args.gates:
            set_partial_gate(model, gate, first_layer)
            row[f"ce@{gate}"] = held_out_ce(model, held, 4)
            logging.info("%s gate %.2f CE %.4f", name, gate, row[f"ce@{gate}"])
            if not row[f"ce@{gate}"] < 20:
                break
        report[name] = row
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
