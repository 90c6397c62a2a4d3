"""Optional packages of the integrations: import one, or fail in one line naming the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import TaperNormError

#: The pip extra of hf-tapernorm that installs each optional package (setup.cfg, [options.extras_require]).
EXTRAS = {
    "transformer_lens": "interpretability",
    "nnsight": "interpretability",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "numpy": "onnx",
}


class MissingExtraError(TaperNormError, ImportError):
    """An integration was used without its optional package installed."""


def require(module: str, feature: str) -> ModuleType:
    """``import module``, or raise MissingExtraError: '<feature> needs <module>: pip install hf-tapernorm[<extra>]'."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        missing = (error.name or top).split(".")[0]
        if missing != top and missing in EXTRAS:
            top = missing  # the extra is half installed: the package is there, another of the extra's is not
        elif missing != top:
            raise  # the package is there but one of its own imports failed: show that error as it is
        raise MissingExtraError(
            f"{feature} needs {top}, which is not installed: pip install 'hf-tapernorm[{EXTRAS[top]}]'"
        ) from None


__all__ = ["EXTRAS", "MissingExtraError", "require"]
