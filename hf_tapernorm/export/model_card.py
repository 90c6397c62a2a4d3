"""Model cards for folded models: the project's template ``model_cards/folded_model.md`` filled from the config
and run facts.

What folding did (folded/kept norms, tied head, added biases, package version) is read from the
folded config and ``fold_report``; what only the caller knows (base model id, license, schedule,
tokens, eval losses, speed) comes in a plain dict, so the CLI can pass whatever it measured.
The YAML header is built with huggingface_hub's ``ModelCardData`` so the Hub understands it.
"""

from __future__ import annotations

import decimal
import numbers
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from huggingface_hub import ModelCard, ModelCardData
from torch import nn

from ..errors import ConfigurationError
from .readout import readout_summary

TEMPLATE_NAME = "folded_model.md"


def template_text() -> str:
    """The card template ``folded_model.md``: the project's top-level ``model_cards/`` folder.

    A built wheel ships that folder inside the package as ``hf_tapernorm/model_cards/`` (setup.cfg maps it),
    read with importlib.resources so every install scheme (wheel, ``--user``, zip) finds it; a source checkout
    (the package on ``PYTHONPATH`` or installed editable) has it beside the package instead.
    """
    packaged = resources.files("hf_tapernorm").joinpath("model_cards", TEMPLATE_NAME)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8")
    raise FileNotFoundError(
        f"hf_tapernorm: the model card template {TEMPLATE_NAME} is neither package data (hf_tapernorm/model_cards/) "
        f"nor in the checkout ({checkout.parent}); reinstall hf_tapernorm from a wheel or a full clone"
    )


# Keys a caller may pass in ``facts`` (all optional).
FACT_KEYS = (
    "base_model",  # Hub id or path of the model that was tapered (default: config.name_or_path)
    "license",  # the base model's license, when known
    "repo_id",  # where the folded model lives (used in the loading snippets)
    "model_name",  # card title (default: derived from repo_id / base model)
    "dataset",  # training data of the tapering run
    "tokens",  # training tokens of the tapering run
    "schedule",  # mapping, e.g. {"taper start (step)": 25, "taper end (step)": 100, "total steps": 300}
    "eval_loss",  # mapping, e.g. {"base": 3.01, "tapered (g = 0)": 3.05, "folded": 3.05}
    "speed",  # mapping of measured figures, e.g. {"folded / base tokens per s (bf16, batch 1)": "1.12x"}
    "robustness_scan",  # the robustness scan's result (hf_tapernorm.evaluation.scan.ScanResult.to_dict())
    "tags",  # extra Hub tags
    "warning",  # one line shown first: the run's model ended far worse than its reference (app/record.py)
)


_TEXT = (str,)
_MAPPING = (Mapping,)
#: The facts whose mapping is shown as a table of figures: each value a number or a text ("1.12x").
_FIGURES = ("eval_loss", "speed")
#: What each fact takes (None, for any, is the fact not given), in the words a refusal says it in.
_FACT_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "base_model": ((str, os.PathLike), "a str (a Hub id or a path)"),
    "license": (_TEXT, "a str"),
    "repo_id": (_TEXT, "a str"),
    "model_name": (_TEXT, "a str"),
    "dataset": (_TEXT, "a str"),
    "tokens": ((numbers.Integral, str), "an int or a str"),
    "schedule": (_MAPPING, "a mapping"),
    "eval_loss": (_MAPPING, "a mapping of numbers or str"),
    "speed": (_MAPPING, "a mapping of numbers or str"),
    "robustness_scan": (_MAPPING, "a mapping (ScanResult.to_dict())"),
    "tags": ((list, tuple), "a list of str"),
    "warning": (_TEXT, "a str"),
}


def _fact_fits(key: str, value: Any) -> bool:
    """Whether ``value`` is of the type fact ``key`` takes (_FACT_TYPES): a str is no list of tags ("abc" would
    be the tags a, b, c), and a bool no token count."""
    types, _ = _FACT_TYPES[key]
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, types):
        return False
    if key in _FIGURES:
        return all(_is_figure(figure) for figure in value.values())
    return key != "tags" or all(isinstance(tag, str) for tag in value)


def _is_figure(value: Any) -> bool:
    """Whether ``value`` is one cell of eval_loss's or speed's table: a text, or one number of any kind."""
    return isinstance(value, str) or _figure_number(value) is not None


def _figure_number(value: Any) -> Optional[float | int]:
    """The number ``value`` holds (a Python or numpy number, a one-element tensor or array) as a Python int or
    float, else None: a tensor would show as "tensor(2.5000)", and a bool or a mapping is no figure. A float of less
    than double precision is read as the shortest text of its own precision (a float32 loss 3.0584 shows as that,
    not as 3.0583999156951904)."""
    try:
        return _read_figure(value)
    except (TypeError, ValueError, RuntimeError, NotImplementedError):  # a timedelta, a dtype holding no number
        return None


def _read_figure(value: Any) -> Optional[float | int]:
    """_figure_number's reading, which may raise for a value that holds no number."""
    if isinstance(value, (bool, str, bytes, np.timedelta64)) or getattr(value, "is_meta", False) is True:
        return None
    numel = getattr(value, "numel", None)
    if callable(numel):  # a tensor: through numpy where it has the dtype (float32's shortest text), else as a float
        if numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.detach().cpu()
        value = value.to_dense() if value.layout != torch.strided else value  # a sparse one
        value = value.dequantize() if value.is_quantized else value
        if value.dtype not in (torch.float16, torch.float32, torch.float64) and value.is_floating_point():
            value = value.float()  # bfloat16, float8: no numpy dtype
        value = value.reshape(()).numpy()
    if isinstance(value, decimal.Decimal):  # a number, which numbers.Real does not count
        return None if value.is_snan() else float(value)  # a signalling NaN: float() refuses it
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0] if value.size == 1 else None
    if isinstance(value, np.floating):
        return float(str(value))
    if isinstance(value, numbers.Integral) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, np.bool_):
        return float(value)
    return None


def _kind(value: Any) -> str:
    """The type of ``value`` a refusal names: a list's or tuple's with the type of its first item that is no str, a
    mapping's with the type of its first value that is no figure (a number or a str)."""
    if isinstance(value, (list, tuple)):
        other = next((item for item in value if not isinstance(item, str)), None)
        if other is not None:
            return f"a {type(value).__name__} holding {type(other).__name__}"
    if isinstance(value, Mapping):
        others = [item for item in value.values() if not _is_figure(item)]  # None among them: a figure not given
        if others:
            return f"a {type(value).__name__} holding {type(others[0]).__name__}"
    return type(value).__name__


def _plain_facts(facts: Mapping[str, Any]) -> dict[str, Any]:
    """``facts`` (checked) with each text as a plain str and each figure as a Python number: the card's YAML writes a
    str subclass (a numpy str, a ``str, Enum`` member) as a python object tag, which its own re-parse refuses."""
    plain = {key: _plain_text(value) for key, value in facts.items()}
    if plain.get("tags"):
        plain["tags"] = [_plain_text(tag) for tag in plain["tags"]]
    if isinstance(plain.get("tokens"), numbers.Integral):
        plain["tokens"] = int(plain["tokens"])  # a numpy int too, so the card writes its thousands separators
    for key in _FIGURES:
        if plain.get(key):
            plain[key] = {_plain_text(name): _plain_figure(value) for name, value in plain[key].items()}
    return plain


def _plain_text(value: Any) -> Any:
    """A str (of any subclass) as the plain str of the text it holds (str() of a ``str, Enum`` member is its name);
    anything else as it is."""
    return str.__str__(value) if isinstance(value, str) else value


def _plain_figure(value: Any) -> float | int | str:
    """One cell of eval_loss's or speed's table (_is_figure): its text, or the number it holds."""
    return _plain_text(value) if isinstance(value, str) else _figure_number(value)


def check_facts(facts: Mapping[Any, Any]) -> None:
    """Refuse, in one ConfigurationError, facts that are not FACT_KEYS and facts of another type than theirs: the
    card would render them wrong ("abc" as three tags) or fail half-way in a bare TypeError or ValueError."""
    unknown = sorted(str(key) for key in facts if key not in FACT_KEYS)
    if unknown:
        raise ConfigurationError(
            f"unknown model card facts: {', '.join(unknown)}; expected some of {', '.join(FACT_KEYS)}"
        )
    wrong = [
        f"{key!r} takes {_FACT_TYPES[key][1]}, got {_kind(value)}"
        for key, value in facts.items()
        if not _fact_fits(key, value)
    ]
    if wrong:
        raise ConfigurationError(f"model card facts of the wrong type: {'; '.join(wrong)}")


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def render_model_card(model: nn.Module, facts: Optional[Mapping[str, Any]] = None) -> str:
    """The README.md text (YAML metadata + Markdown) for a folded model and the given run facts (check_facts: each
    of FACT_KEYS, of its type; None is a fact not given)."""
    facts = dict(facts or {})
    check_facts(facts)
    facts = _plain_facts(facts)
    config = model.config
    base_model = str(facts.get("base_model") or config.name_or_path or config.base_model_type)
    repo_id = facts.get("repo_id") or "path/to/exported/folder"
    model_name = facts.get("model_name") or (
        repo_id.split("/")[-1] if facts.get("repo_id") else f"{Path(base_model).name} (norm-free)"
    )
    card_data = ModelCardData(
        base_model=base_model if _is_hub_id(base_model) else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=facts.get("license"),
        tags=["hf_tapernorm", "tapernorm", "norm-free", config.base_model_type, *(facts.get("tags") or [])],
    )
    if config.final_norm in config.scaled_norms:
        final_summary = "tapered; kept as one explicit per-channel scale so the tied embeddings survive"
    elif config.final_norm in config.folded_norms:
        final_summary = "tapered and folded into `lm_head`" + (
            " (the head was untied from the embeddings: `tie_word_embeddings=False`)"
            if config.tied_head == "untie"
            else ""
        )
    elif config.final_norm in (getattr(config, "weightless_norms", None) or {}):
        final_summary = "kept as a real norm (Internal-Taper), its weight folded into `lm_head`" + (
            " (the head was untied from the embeddings)" if not getattr(config, "tie_word_embeddings", True) else ""
        )
    else:
        final_summary = "kept as a real norm (Internal-Taper)"
    readout = (
        "affine: the logits are a linear map of the residual stream plus a constant, so direct logit attribution "
        "is exact"
        if readout_summary(config)["affine"]
        else "through the final norm: each token's logits depend on its scale (attributions need that scale frozen)"
    )
    report = getattr(model, "fold_report", None)
    card = ModelCard.from_template(
        card_data,
        template_str=template_text(),
        model_name=model_name,
        base_model=base_model,
        base_model_link=f"https://huggingface.co/{base_model}" if _is_hub_id(str(base_model)) else None,
        base_model_type=config.base_model_type,
        model_type=config.model_type,
        folded_count=len(config.folded_norms),
        folded_example=config.folded_norms[0] if config.folded_norms else "",
        kept_summary=f"{len(config.kept_norms)}" + (f" (e.g. `{config.kept_norms[0]}`)" if config.kept_norms else ""),
        final_norm_summary=final_summary,
        readout_summary=readout,
        added_biases_summary=", ".join(f"`{p}`" for p in config.added_biases) or "none",
        sink_ids=list(getattr(config, "sink_token_ids", None) or []),
        sink_summary=(
            f"token id(s) {list(config.sink_token_ids)}: keys/values of {len(config.sink_token_ids)} position(s) "
            "stored per layer"
            if getattr(config, "sink_token_ids", None)
            else "none"
        ),
        hf_tapernorm_version=config.hf_tapernorm_version,
        dataset=facts.get("dataset"),
        tokens=f"{facts['tokens']:,}" if isinstance(facts.get("tokens"), int) else facts.get("tokens"),
        schedule=dict(facts.get("schedule") or {}),
        eval_loss=dict(facts.get("eval_loss") or {}),
        speed=dict(facts.get("speed") or {}),
        robustness=dict(facts.get("robustness_scan") or {}),
        fold_report=report.to_dict() if report is not None else None,
        repo_id=repo_id,
        warning=facts.get("warning"),
    )
    return re.sub(r"\n{3,}", "\n\n", str(card))  # optional sections leave blank runs


def attach_model_card(model: nn.Module, facts: Optional[Mapping[str, Any]] = None) -> str:
    """Render the card for ``model`` and attach it, so save_pretrained/push_to_hub write it as README.md."""
    model.model_card = render_model_card(model, facts)
    return model.model_card


__all__ = ["FACT_KEYS", "attach_model_card", "check_facts", "render_model_card"]
