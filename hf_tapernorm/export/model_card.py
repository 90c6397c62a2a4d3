"""Model cards for folded models: the project's template ``model_cards/folded_model.md`` filled from the config
and run facts.

What folding did (folded/kept norms, tied head, added biases, package version) is read from the
folded config and ``fold_report``; what only the caller knows (base model id, license, schedule,
tokens, eval losses, speed) comes in a plain dict, so the CLI can pass whatever it measured.
The YAML header is built with huggingface_hub's ``ModelCardData`` so the Hub understands it.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Optional

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
#: What each fact takes (None, for any, is the fact not given), in the words a refusal says it in.
_FACT_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "base_model": ((str, os.PathLike), "a str (a Hub id or a path)"),
    "license": (_TEXT, "a str"),
    "repo_id": (_TEXT, "a str"),
    "model_name": (_TEXT, "a str"),
    "dataset": (_TEXT, "a str"),
    "tokens": ((numbers.Integral, str), "an int or a str"),
    "schedule": (_MAPPING, "a mapping"),
    "eval_loss": (_MAPPING, "a mapping"),
    "speed": (_MAPPING, "a mapping"),
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
    return key != "tags" or all(isinstance(tag, str) for tag in value)


def _kind(value: Any) -> str:
    """The type of ``value`` a refusal names: a list's or tuple's with the type of its first item that is no str."""
    if isinstance(value, (list, tuple)):
        other = next((item for item in value if not isinstance(item, str)), None)
        if other is not None:
            return f"a {type(value).__name__} holding {type(other).__name__}"
    return type(value).__name__


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
