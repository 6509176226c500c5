"""Find a model's weights offline and safely: folders, cache ids, GGUF files, named models.

Every source resolves to a folder in the ``save_pretrained`` layout with safetensors
weights; a GGUF file is dequantized to float32 once and cached as safetensors,
keyed by the file's sha256. Pickle weights are refused: unpickling runs code.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ModelLoadError, did_you_mean, first_line, one_line
from ..errors import warn as warn
from ..fsio import (
    JsonUnreadable,
    read_json,
)
from ..fsio import cache_root as cache_root
from ..fsio import sha256_of as sha256_of
from ..options import flag
from .gguf_cache import MARKER as MARKER
from .gguf_cache import SAFETENSORS_SUFFIX, gguf_to_folder
from .gguf_cache import cache_entry_problem as cache_entry_problem
from .gguf_cache import check_gguf as check_gguf
from .gguf_cache import dequantizable_types as dequantizable_types
from .gguf_cache import quiet_transformers as quiet_transformers
from .gguf_cache import safetensors_complete as safetensors_complete
from .named import named_model_path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are: the spec the user gave and the folder we load."""

    spec: str  # what the user typed
    kind: str  # "named", "folder", "cache", "gguf"
    folder: Path  # save_pretrained layout with safetensors weights
    origin: Path  # the folder or .gguf file the weights came from

    @property
    def name(self) -> str:
        """A short name for messages and baseline file names."""
        if self.kind == "named" or self.kind == "cache":
            return self.spec
        return self.origin.stem if self.origin.suffix == ".gguf" else self.origin.name


# ---------------------------------------------------------------- which weight files load


def _named_file(folder: Path, name, named_by: str, suffix: str = SAFETENSORS_SUFFIX) -> Path:
    """``folder/name`` for a weight file another file names: inside the folder, safetensors, present."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"model folder {folder}: {named_by} names a weight file {name!r} that is not a file name")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        raise ModelLoadError(
            f"model folder {folder}: {named_by} names {name!r}, outside the folder; weights must lie in the folder"
        )
    if not name.endswith(suffix):
        raise ModelLoadError(
            f"model folder {folder}: {named_by} names the non-safetensors weight file {name!r}; loading it could "
            "unpickle code: re-save the model with save_pretrained(safe_serialization=True)"
        )
    file = folder / name
    if not file.is_file():
        raise ModelLoadError(f"model folder {folder}: {named_by} names {name!r}, which is missing; re-save the model")
    return file


def _index_files(folder: Path, index: Path) -> list[Path]:
    """The files a ``*.safetensors.index.json`` maps tensors to, each checked by `_named_file`."""
    try:
        weight_map = read_json(index)["weight_map"]
        names = sorted(set(weight_map.values()))
    except JsonUnreadable as error:
        raise ModelLoadError(f"model folder {folder}: {index.name} {error.reason}; re-save the model") from None
    except (KeyError, TypeError, AttributeError) as error:
        raise ModelLoadError(
            f"model folder {folder}: {index.name} is not a weight index ({first_line(error)}); re-save the model"
        ) from None
    if not names:
        raise ModelLoadError(f"model folder {folder}: {index.name} maps no tensors; re-save the model")
    return [_named_file(folder, name, index.name) for name in names]


def _config_weights_name(folder: Path):
    try:
        config = read_json(folder / "config.json")
    except JsonUnreadable as error:
        raise ModelLoadError(
            f"model folder {folder}: config.json {error.reason}; fix it or save the model again"
        ) from None
    return config.get("transformers_weights") if isinstance(config, dict) else None


def weight_files(folder: Path) -> list[Path]:
    """Exactly the weight files ``from_pretrained(folder, use_safetensors=True)`` reads, in name order.

    transformers' order for a local folder: the config's ``transformers_weights`` file, else
    ``model.safetensors``, else every file ``model.safetensors.index.json`` maps to. A named
    file that is not ``*.safetensors`` (``pytorch_model.bin`` in an index: transformers would
    unpickle it) or lies outside the folder is refused with one line.
    """
    folder = Path(folder)
    explicit = _config_weights_name(folder)
    if explicit is not None:
        if isinstance(explicit, str) and explicit.endswith(".safetensors.index.json"):
            by = "config.json's transformers_weights"
            return _index_files(folder, _named_file(folder, explicit, by, ".safetensors.index.json"))
        return [_named_file(folder, explicit, "config.json's transformers_weights")]
    single = folder / SAFE_WEIGHTS
    if single.is_file():
        return [single]
    index = folder / SAFE_INDEX
    if index.is_file():
        return _index_files(folder, index)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"model folder {folder} holds only pickle weights ({', '.join(pickles)}); "
            "loading them would run code: re-save with save_pretrained(safe_serialization=True)"
        )
    raise ModelLoadError(f"model folder {folder} has no {SAFE_WEIGHTS} or {SAFE_INDEX}; save it with save_pretrained")


def weight_fingerprint(folder: Path) -> str:
    """``sha256:`` over the name and sha256 of every file in `weight_files` (the model's identity)."""
    digest = hashlib.sha256()
    for file in weight_files(folder):
        digest.update(file.name.encode())
        digest.update(sha256_of(file).encode())
    return "sha256:" + digest.hexdigest()


def check_folder(folder: Path) -> Path:
    """A loadable ``save_pretrained`` folder, or a one-line reason it is not (see `weight_files`)."""
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist; pass a save_pretrained folder")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json; save it with save_pretrained")
    weight_files(folder)
    return folder


# ---------------------------------------------------------------- non-finite weights


def nonfinite_counts(folder: Path) -> list[tuple[str, str, int, int]]:
    """``(file, tensor, n_nan, n_inf)`` of every floating tensor in `weight_files` holding NaN or inf."""
    found: list[tuple[str, str, int, int]] = []
    for file in weight_files(folder):
        stat = file.stat()
        found.extend(_file_nonfinite(str(file), stat.st_size, stat.st_mtime_ns))
    return found


def nonfinite_of(tensor) -> tuple[int, int] | None:
    """``(n_nan, n_inf)`` of a float tensor holding any, else None (integer tensors: None).

    Fast path: NaN and inf propagate through a sum, so a finite sum means every entry is
    finite; only a non-finite sum (which overflow alone can also give) is counted exactly.
    """
    import torch

    if not tensor.is_floating_point():
        return None
    if tensor.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        tensor = tensor.float()
    if bool(torch.isfinite(tensor.sum())):
        return None
    n_nan, n_inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    return (n_nan, n_inf) if n_nan or n_inf else None


@lru_cache(maxsize=64)
def _file_nonfinite(path: str, size: int, mtime_ns: int) -> tuple:
    from safetensors import safe_open

    found = []
    try:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                counts = nonfinite_of(tensor)
                if counts is not None:
                    n_nan, n_inf = counts
                    found.append((Path(path).name, name, n_nan, n_inf))
    except Exception as error:  # safetensors raises its own error type for a damaged file
        raise ModelLoadError(f"weight file {path} cannot be read: {first_line(error)}; re-save the model") from None
    return tuple(found)


def nonfinite_line(
    what: str,
    tensor: str,
    n_nan: int,
    n_inf: int,
    more: int,
    fix: str = "every figure would be meaningless: re-export the weights",
) -> str:
    """``"... model.layers.1.self_attn.o_proj.weight holds 12 NaN values ..."`` (one line)."""
    counts = " and ".join(f"{n} {kind} values" for n, kind in ((n_nan, "NaN"), (n_inf, "inf")) if n)
    also = f" ({more} more tensors too)" if more else ""
    return f"{what}: {tensor} holds {counts}{also}; {fix}"


def check_finite_weights(source: ModelSource) -> None:
    """Refuse a checkpoint whose float tensors hold NaN or inf, naming the first tensor and its counts.

    Reads the float source checkpoint (`weight_files`), so every build is covered: a quantized
    build is made from these weights (a GGUF file's are already dequantized in its cache folder).
    """
    bad = nonfinite_counts(source.folder)
    if bad:
        file, tensor, n_nan, n_inf = bad[0]
        raise ModelLoadError(nonfinite_line(f"weights of {source.name} ({file})", tensor, n_nan, n_inf, len(bad) - 1))


def hub_cache_folder(repo_id: str) -> Path | None:
    """The newest local snapshot of a hub id, looked up with the hub forced offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        return None


def resolve_model(spec: str | os.PathLike) -> ModelSource:
    """Turn what the user typed into a loadable folder, without touching the network.

    Tried in order: a named model, a path to a folder, a path to a ``.gguf`` file,
    a model id in the local Hugging Face cache.
    """
    text = str(spec)
    named = named_model_path(text)
    if named is not None:
        if named.suffix == ".gguf":
            return ModelSource(text, "named", gguf_to_folder(named), named)
        return ModelSource(text, "named", check_folder(named), named)
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource(text, "folder", check_folder(path), path)
    if path.suffix == ".gguf" or path.is_file():
        return ModelSource(text, "gguf", gguf_to_folder(path), path)
    looks_like_path = os.sep in text or text.startswith(".")
    if not looks_like_path or text.count("/") == 1:
        cached = hub_cache_folder(text)
        if cached is not None:
            return ModelSource(text, "cache", check_folder(cached), cached)
    from .named import NAMED_MODELS

    raise ModelLoadError(
        f"model {text!r} not found{did_you_mean(text, NAMED_MODELS)}: not a folder, a .gguf file, a named model "
        f"({', '.join(NAMED_MODELS)}), or an id in the local Hugging Face cache"
    )


def read_config(folder, trust_remote_code: bool = False, what: str | None = None):
    """The transformers config of a weights folder; an unknown architecture, or a config transformers'
    own checks refuse (``StrictDataclassFieldValidationError``, ``TypeError``, ``ZeroDivisionError``), is one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as error:
        hint = (
            f"{flag('trust-remote-code')} was given and cannot help: the folder has no code for it; a newer "
            "transformers may know it"
            if trust_remote_code
            else f"pass {flag('trust-remote-code')} only if you trust it"
        )
        raise ModelLoadError(f"model {what or str(folder)!r}: {first_line(error)} ({hint})") from None
    except Exception as error:
        raise ModelLoadError(
            f"model {what or str(folder)!r}: transformers refuses its config.json ({type(error).__name__}: "
            f"{one_line(error)}); fix config.json or save the model again"
        ) from None
