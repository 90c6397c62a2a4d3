#!/usr/bin/env python
"""Direct logit attribution and the logit lens on a folded export, beside the normalized model it came from.

Each position's logit of its next token is split over the residual stream's parts entering the final norm (the
embedding, every attention and MLP output) in two ways:

- the attribution: the part through the readout with the final norm's scale frozen at its value on the whole
  stream (what direct logit attribution reads; on a folded final norm there is no scale and the readout is
  affine);
- the direct effect: how much the logit drops when that part alone is removed from the stream entering the final
  norm (the readout recomputed, its norm included).

On an affine readout (the final norm folded, ``scope="all"``) the two are equal, the parts add up to the logit,
and the logit lens at each layer (the stream so far through the readout) is the readout's constant plus the
attributions of the parts so far. Through a real final norm (the normalized model, or an export that keeps its
final norm, as the default recipe does) the attributions add up only because the scale is frozen, the direct
effects miss the logit, and the lens reads each layer with its own scale.

Both models are read twice: in plain transformers (forward hooks on each layer's attention and MLP) and in
TransformerLens, with its own tools (``direct_logit_attribution`` and ``logit_lens`` on a ``TransformerBridge``
in compatibility mode, which those tools require; the export's bridge from ``hf_tapernorm.integrations``).
TransformerLens's processed weights shift each position's logits by a constant, so its figures are in its own
coordinates; both backends' differences should agree.

    python conversion_scripts/logit_attribution.py EXPORT_DIR [ORIGINAL] [--tokens 128] [--output_json F]

ORIGINAL: a Hub id, folder or .gguf file (default: the embedded SmolLM2-135M); it must have the export's layers.
The TransformerLens half needs the interpretability extra (pip install 'hf-tapernorm[interpretability]'); without
it, ``--backends transformers`` reads plain transformers only.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_tapernorm.evaluation import load_model, load_tokenizer, resolve_model
from hf_tapernorm.export import final_norm_path
from hf_tapernorm.integrations import load_export, require, transformer_bridge

LENS_ROWS = 6  # the logit lens is printed at this many layers, evenly spaced, the last one among them


@dataclass
class Decomposition:
    """One text through one model: the parts of the stream entering the final norm and the readouts of it.

    ``parts``: [component, position, d_model]; ``logit``: each position's logit of its next token;
    ``readout(x)``: the logits of streams x (the final norm, then the head); ``attributions``: each part's target
    logit through the readout with the norm's scale frozen at the whole stream's, without constants;
    ``constant``: what the readout adds to the target logit whatever the stream (the head's bias, a LayerNorm's
    beta through the head; for a folded final norm, the readout of 0)."""

    names: list[str]
    parts: torch.Tensor
    stream: torch.Tensor
    targets: torch.Tensor
    logit: torch.Tensor
    readout: Callable[[torch.Tensor], torch.Tensor]
    attributions: torch.Tensor  # [component, position]
    constant: torch.Tensor  # [position]

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        return pick(logits, self.targets)


def pick(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's logit of its target: ``logits`` [position, vocab] -> [position]."""
    return logits[torch.arange(len(targets)), targets]


# ----------------------------------------------------------------------------- plain transformers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Llama-like (``model.layers``) or GPT-2-like (``transformer.h``) causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise SystemExit(f"logit_attribution.py: cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def effective_norm(norm: nn.Module, width: int) -> tuple[bool, float | None, torch.Tensor, torch.Tensor]:
    """(centred, eps, weight, bias) of a final norm, read by probing it (Gemma's ``1 + w`` and a weightless norm
    alike); eps None for a module that does not normalize (a folded norm's identity)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    zeros = torch.zeros(width)
    if eps is None:
        return False, None, torch.ones(width), zeros
    centred = isinstance(norm, nn.LayerNorm)
    if centred:
        weight = norm.weight if norm.weight is not None else torch.ones(width)
        bias = norm.bias if norm.bias is not None else zeros
        return True, eps, weight.detach().float(), bias.detach().float()
    ones = torch.ones(1, width)
    weight = norm(ones)[0].float() * (1 + eps) ** 0.5  # an RMS norm of ones divides by sqrt(1 + eps)
    return False, eps, weight.detach(), zeros


@torch.no_grad()
def transformers_decomposition(model: nn.Module, ids: torch.Tensor, skip: int) -> Decomposition:
    """The decomposition read with forward hooks; ``skip`` leading columns (a sink the model reads) dropped."""
    layers = decoder_layers(model)
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            captured[name] = (output[0] if isinstance(output, tuple) else output)[0]

        return hook

    def keep_input(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            captured[name] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    norm = model.get_submodule(final_norm_path(model))
    handles = [layers[0].register_forward_pre_hook(keep_input("embed"), with_kwargs=True)]
    handles.append(norm.register_forward_pre_hook(keep_input("stream"), with_kwargs=True))
    names = ["embed"]
    for i, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None) or layer.attn
        handles += [attention.register_forward_hook(keep(f"attn{i}")), layer.mlp.register_forward_hook(keep(f"mlp{i}"))]
        names += [f"attn{i}", f"mlp{i}"]
    try:
        logits = model(input_ids=ids).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    parts = torch.stack([captured[name][skip:-1].float() for name in names])
    stream = captured["stream"][skip:-1].float()
    targets = ids[0, skip + 1 :]
    head = model.get_output_embeddings()
    centred, eps, weight, bias = effective_norm(norm, stream.shape[-1])

    def readout(x: torch.Tensor) -> torch.Tensor:
        return head(norm(x.to(head.weight.dtype))).float()

    if eps is None:  # a folded final norm: the readout is affine already
        zero = readout(torch.zeros_like(stream))
        frozen = lambda part: readout(part) - zero  # noqa: E731
        constant = zero
    else:
        centre = (lambda x: x - x.mean(-1, keepdim=True)) if centred else (lambda x: x)
        scale = (centre(stream).pow(2).mean(-1, keepdim=True) + eps).sqrt()
        frozen = lambda part: nn.functional.linear(centre(part) / scale * weight, head.weight.float())  # noqa: E731
        head_bias = head.bias.float() if head.bias is not None else 0.0
        constant = nn.functional.linear(bias.expand_as(stream), head.weight.float()) + head_bias
    attributions = torch.stack([pick(frozen(part), targets) for part in parts])
    return Decomposition(
        names, parts, stream, targets, pick(logits[skip:-1], targets), readout, attributions, pick(constant, targets)
    )


# ----------------------------------------------------------------------------- TransformerLens


@torch.no_grad()
def lens_decomposition(bridge: Any, ids: torch.Tensor, skip: int) -> Decomposition:
    """The decomposition read by TransformerLens's own DLA tool on a bridge in compatibility mode."""
    analysis = require("transformer_lens.tools.analysis", "conversion_scripts/logit_attribution.py")
    logits, cache = bridge.run_with_cache(ids)
    answers = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # the next token at each position (the last one unused)
    result = analysis.direct_logit_attribution(bridge, answer_tokens=answers, pos=None, cache=cache)
    parts, names = cache.decompose_resid(layer=None, mode="all", return_labels=True)
    parts = parts[:, 0, skip:-1].float()
    stream = cache["ln_final.hook_in"][0, skip:-1].float()
    targets = ids[0, skip + 1 :]

    def readout(x: torch.Tensor) -> torch.Tensor:
        return bridge.unembed(bridge.ln_final(x[None]))[0].float()

    b_u = getattr(bridge.unembed, "b_U", None)
    constant = b_u[targets].float() if torch.is_tensor(b_u) else torch.zeros(len(targets))
    return Decomposition(
        list(names),
        parts,
        stream,
        targets,
        pick(logits[0, skip:-1].float(), targets),
        readout,
        result.attribution[:, 0, skip:-1].float(),
        constant,
    )


# ----------------------------------------------------------------------------- the figures


@torch.no_grad()
def figures(view: Decomposition) -> dict[str, Any]:
    """The attribution table, the largest components and the lens of one decomposition."""
    whole = view.pick(view.readout(view.stream))
    effects = torch.stack([whole - view.pick(view.readout(view.stream - part)) for part in view.parts])
    summed = {
        "components": len(view.names),
        "positions": len(view.targets),
        "mean |logit|": view.logit.abs().mean().item(),
        "parts add up to the stream (max abs)": (view.parts.sum(0) - view.stream).abs().max().item(),
        "readout vs forward (max abs)": (whole - view.logit).abs().max().item(),
        "attributions + constant vs logit (max abs)": (view.attributions.sum(0) + view.constant - view.logit)
        .abs()
        .max()
        .item(),
        "direct effects + constant vs logit (mean abs)": (effects.sum(0) + view.constant - view.logit)
        .abs()
        .mean()
        .item(),
        "direct effects + constant vs logit (max abs)": (effects.sum(0) + view.constant - view.logit)
        .abs()
        .max()
        .item(),
        "direct effect vs attribution (mean abs)": (effects - view.attributions).abs().mean().item(),
        "direct effect vs attribution (max abs)": (effects - view.attributions).abs().max().item(),
        "mean |attribution|": view.attributions.abs().mean().item(),
    }
    largest = view.attributions.abs().mean(1).argsort(descending=True)[:6]
    components = {
        view.names[i]: {
            "attribution": view.attributions[i].mean().item(),
            "direct effect": effects[i].mean().item(),
            "|direct effect - attribution|": (effects[i] - view.attributions[i]).abs().mean().item(),
        }
        for i in largest.tolist()
    }
    final = view.readout(view.stream).argmax(-1)
    lens = {}
    # The embedding's parts come first (TransformerLens splits off GPT-2's positions), then attention and MLP.
    embedding = next(i for i, name in enumerate(view.names) if "attn" in name or "mlp" in name)
    layers = (len(view.names) - embedding) // 2
    for layer in sorted({round(k * (layers - 1) / (LENS_ROWS - 1)) for k in range(LENS_ROWS)}):
        upto = embedding + 2 * (layer + 1)  # the embedding and layers 0..layer
        logits = view.readout(view.parts[:upto].sum(0))
        cumulative = view.constant + view.attributions[:upto].sum(0)
        lens[f"layer {layer}"] = {
            "top-1 as the output's": (logits.argmax(-1) == final).float().mean().item(),
            "lens vs constant + attributions so far (mean abs)": (view.pick(logits) - cumulative).abs().mean().item(),
        }
    return {"summed": summed, "components": components, "lens": lens}


def print_table(title: str, columns: dict[str, dict[str, Any]]) -> None:
    names = list(columns)
    rows = list(next(iter(columns.values())))
    width = max(len(str(row)) for row in rows)
    print(f"\n{title}\n{'':<{width}}  " + "  ".join(f"{name:>24}" for name in names))
    for row in rows:
        cells = [columns[name].get(row) for name in names]
        text = [f"{cell:>24.4g}" if isinstance(cell, (int, float)) else f"{'-':>24}" for cell in cells]
        print(f"{row:<{width}}  " + "  ".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", help="a folder export_folded wrote (config.json, model.safetensors)")
    parser.add_argument("original", nargs="?", default=None, help="the normalized model (default: embedded)")
    parser.add_argument("--gguf_file", default=None, help="GGUF file name inside ORIGINAL")
    parser.add_argument("--tokens", type=int, default=128, help="text tokens (textwrap.py of the standard library)")
    parser.add_argument("--backends", nargs="+", default=["transformers", "transformer_lens"])
    parser.add_argument("--output_json", type=Path, default=None, help="also write every figure here")
    args = parser.parse_args()
    source = resolve_model(args.original, args.gguf_file)
    tokenizer = load_tokenizer(source)
    original = load_model(source, dtype="float32").eval()
    export = load_export(Path(args.export_dir), dtype=torch.float32).eval()
    if export.config.num_hidden_layers != original.config.num_hidden_layers:
        raise SystemExit(
            f"logit_attribution.py: the export has {export.config.num_hidden_layers} layers, the original "
            f"{original.config.num_hidden_layers}: name the model the export was folded from"
        )
    text = (Path(os.__file__).parent / "textwrap.py").read_text()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, : args.tokens]
    sink = list(export.config.sink_token_ids or [])
    # The export holds its sink as a cache prefix and reads the text alone; the normalized model reads it first.
    with_sink = torch.cat([torch.tensor([sink], dtype=ids.dtype), ids], 1)
    results: dict[str, dict[str, Any]] = {}
    if "transformers" in args.backends:
        results["transformers"] = {
            "folded export": figures(transformers_decomposition(export, ids, 0)),
            "normalized": figures(transformers_decomposition(original, with_sink, len(sink))),
        }
    if "transformer_lens" in args.backends:
        model_bridge = require("transformer_lens.model_bridge", "conversion_scripts/logit_attribution.py")
        bridges = {
            "folded export": transformer_bridge(Path(args.export_dir), tokenizer=tokenizer, device="cpu"),
            "normalized": model_bridge.TransformerBridge.boot_transformers(
                str(source.path), hf_model=original, tokenizer=tokenizer, device="cpu"
            ),
        }
        results["transformer_lens"] = {}
        for name, bridge in bridges.items():
            bridge.enable_compatibility_mode(disable_warnings=True)  # TransformerLens's DLA and lens need it
            ids_in, skip = (ids, 0) if name == "folded export" else (with_sink, len(sink))
            results["transformer_lens"][name] = figures(lens_decomposition(bridge, ids_in, skip))
    folded = export.config
    print(
        f"export: {args.export_dir}; folded norms {len(folded.folded_norms)}, kept {len(folded.kept_norms)}, "
        f"final norm {'folded' if folded.final_norm in folded.folded_norms else 'kept'}; sink {sink}"
    )
    for backend, models in results.items():
        print_table(f"[{backend}] over {args.tokens - 1} positions", {k: v["summed"] for k, v in models.items()})
        for name, values in models.items():
            print_table(f"[{backend}] {name}: the six largest components (means)", values["components"])
        print_table(f"[{backend}] the logit lens", {k: flatten(v["lens"]) for k, v in models.items()})
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=1))


def flatten(lens: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{layer}: {key}": value for layer, row in lens.items() for key, value in row.items()}


if __name__ == "__main__":
    main()
