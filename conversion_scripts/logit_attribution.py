#!/usr/bin/env python
"""Direct logit attribution on a folded export against the normalized model it came from.

Both models are opened in TransformerLens (``TransformerBridge``; the export through
``hf_tapernorm.integrations.tl_bridge``). The residual stream entering the final norm is split into its
components, the embedding and every attention and MLP output (``blocks.0.hook_resid_pre``,
``blocks.{i}.hook_attn_out``, ``blocks.{i}.hook_mlp_out``), and each position's logit of its next token is
attributed to them in two ways:

- the attribution: the component through the readout as TransformerLens's DLA reads it, the final norm's
  scale frozen at its value on the whole stream (on a folded final norm there is no scale: the readout is
  affine, and the attribution is exact);
- the direct effect: how much the logit drops when the component alone is removed from the stream that
  enters the final norm (the readout recomputed, its norm included).

On an affine readout (the final norm folded, ``scope="all"``) the two are equal and sum to the logit. Through
a real final norm (the normalized model, or an export that keeps its final norm, as the default recipe does)
the attributions sum to the logit only because the scale is frozen, and the direct effects differ from them.

    python conversion_scripts/logit_attribution.py EXPORT_DIR [ORIGINAL] [--tokens 128]

ORIGINAL: a Hub id, folder or .gguf file (default: the embedded SmolLM2-135M); it must have the export's
layers. Needs the interpretability extra (pip install 'hf-tapernorm[interpretability]').
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from hf_tapernorm.evaluation import load_model, load_tokenizer, resolve_model
from hf_tapernorm.integrations import require, transformer_bridge


def components(cache: Any, layers: int) -> tuple[list[str], torch.Tensor]:
    """Names and stacked tensors [component, pos, d_model] of the residual stream's parts (batch row 0)."""
    names, parts = ["embed"], [cache["blocks.0.hook_resid_pre"][0]]
    for i in range(layers):
        names += [f"attn{i}", f"mlp{i}"]
        parts += [cache[f"blocks.{i}.hook_attn_out"][0], cache[f"blocks.{i}.hook_mlp_out"][0]]
    return names, torch.stack(parts)


def readout(bridge: Any, stream: torch.Tensor) -> torch.Tensor:
    """Logits of a residual stream entering the final norm: the final norm (or its identity), then the head."""
    return bridge.unembed(bridge.ln_final(stream))


def frozen_readout(bridge: Any, part: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The readout of one component with the final norm's per-position scale frozen (no bias: counted once)."""
    norm = bridge.ln_final
    if not hasattr(norm.original_component, "weight"):  # a folded final norm: nothing to freeze
        return readout(bridge, part) - readout(bridge, torch.zeros_like(part))
    centred = part if norm.uses_rms_norm else part - part.mean(-1, keepdim=True)
    head = bridge.unembed.original_component
    return torch.nn.functional.linear(centred / scale * norm.original_component.weight, head.weight)


def readout_constant(bridge: Any, like: torch.Tensor) -> torch.Tensor:
    """What the readout adds whatever the stream: the head's bias and a LayerNorm's beta through the head (for a
    folded final norm, the readout of a zero stream)."""
    norm = bridge.ln_final
    if not hasattr(norm.original_component, "weight"):
        return readout(bridge, torch.zeros_like(like))
    head = bridge.unembed.original_component
    bias = getattr(norm.original_component, "bias", None)
    beta = bias if bias is not None and not norm.uses_rms_norm else torch.zeros_like(like)
    return torch.nn.functional.linear(beta.expand_as(like), head.weight, head.bias)


@torch.no_grad()
def attribution(bridge: Any, ids: torch.Tensor, skip: int) -> dict[str, float]:
    """Attribution and direct-effect errors over the positions after the first ``skip`` (a sink prefix)."""
    logits, cache = bridge.run_with_cache(ids)
    layers = bridge.cfg.n_layers
    names, parts = components(cache, layers)
    stream = cache["ln_final.hook_in"][0]
    targets = ids[0, skip + 1 :]
    positions = torch.arange(skip, ids.shape[1] - 1)
    logit = logits[0, positions, targets]
    parts, stream = parts[:, positions], stream[positions]
    scale = cache["ln_final.hook_scale"][0, positions]
    pick = lambda values: values[torch.arange(len(targets)), targets]  # noqa: E731
    baseline = pick(readout(bridge, stream))
    constant = pick(readout_constant(bridge, stream))
    attributions = torch.stack([pick(frozen_readout(bridge, part, scale)) for part in parts])
    effects = torch.stack([baseline - pick(readout(bridge, stream - part)) for part in parts])
    return {
        "components": len(names),
        "positions": len(targets),
        "mean |logit|": logit.abs().mean().item(),
        "readout vs forward (max abs)": (baseline - logit).abs().max().item(),
        "constant term (mean abs)": constant.abs().mean().item(),
        "attributions + constant vs logit (max abs)": (attributions.sum(0) + constant - logit).abs().max().item(),
        "direct effects + constant vs logit (mean abs)": (effects.sum(0) + constant - logit).abs().mean().item(),
        "direct effects + constant vs logit (max abs)": (effects.sum(0) + constant - logit).abs().max().item(),
        "direct effect vs attribution (mean abs)": (effects - attributions).abs().mean().item(),
        "direct effect vs attribution (max abs)": (effects - attributions).abs().max().item(),
        "mean |attribution|": attributions.abs().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", help="a folder export_folded wrote (config.json, model.safetensors)")
    parser.add_argument("original", nargs="?", default=None, help="the normalized model (default: embedded)")
    parser.add_argument("--gguf_file", default=None, help="GGUF file name inside ORIGINAL")
    parser.add_argument("--tokens", type=int, default=128, help="text tokens (textwrap.py of the standard library)")
    args = parser.parse_args()
    model_bridge = require("transformer_lens.model_bridge", "conversion_scripts/logit_attribution.py")
    source = resolve_model(args.original, args.gguf_file)
    tokenizer = load_tokenizer(source)
    original = load_model(source, dtype="float32").eval()
    export = transformer_bridge(Path(args.export_dir), tokenizer=tokenizer, device="cpu")
    if export.cfg.n_layers != original.config.num_hidden_layers:
        raise SystemExit(
            f"logit_attribution.py: the export has {export.cfg.n_layers} layers, the original "
            f"{original.config.num_hidden_layers}: name the model the export was folded from"
        )
    normalized = model_bridge.TransformerBridge.boot_transformers(
        str(source.path), hf_model=original, tokenizer=tokenizer, device="cpu"
    )
    text = (Path(os.__file__).parent / "textwrap.py").read_text()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, : args.tokens]
    sink = list(export.original_model.config.sink_token_ids or [])
    # The export holds its sink as a cache prefix and reads the text alone; the normalized model reads it first.
    results = {
        "folded export": attribution(export, ids, 0),
        "normalized original": attribution(normalized, torch.cat([torch.tensor([sink]), ids], 1), len(sink)),
    }
    folded = export.original_model.config
    print(
        f"export: {args.export_dir}; folded norms {len(folded.folded_norms)}, kept {len(folded.kept_norms)}, "
        f"final norm {'folded' if folded.final_norm in folded.folded_norms else 'kept'}; sink {sink}"
    )
    width = max(len(key) for key in results["folded export"])
    print(f"{'':<{width}}  {'folded export':>14}  {'normalized':>14}")
    for key in results["folded export"]:
        a, b = results["folded export"][key], results["normalized original"][key]
        print(f"{key:<{width}}  {a:>14.6g}  {b:>14.6g}")


if __name__ == "__main__":
    main()
