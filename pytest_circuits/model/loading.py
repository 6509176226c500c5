"""Find a model's weights offline and safely: folders, cache ids, GGUF files, named models.

Every source resolves to a folder in the ``save_pretrained`` layout with safetensors
weights; a GGUF file is dequantized to float32 once and cached as safetensors,
keyed by the file's sha256. Pickle weights are refused: unpickling runs code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError, first_line
from .named import named_model_path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
GGUF_MAGIC = b"GGUF"


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


def cache_root() -> Path:
    """``$PYTEST_CIRCUITS_CACHE``, else ``$XDG_CACHE_HOME/pytest-circuits``, else ``~/.cache/...``."""
    env = os.environ.get("PYTEST_CIRCUITS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pytest-circuits"


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def weight_fingerprint(folder: Path) -> str:
    """``sha256:`` of the folder's safetensors files, in name order (the model's identity)."""
    digest = hashlib.sha256()
    for file in sorted(Path(folder).glob("*.safetensors")):
        digest.update(file.name.encode())
        digest.update(sha256_of(file).encode())
    return "sha256:" + digest.hexdigest()


def check_folder(folder: Path) -> Path:
    """A loadable ``save_pretrained`` folder, or a one-line reason it is not."""
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist; pass a save_pretrained folder")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json; save it with save_pretrained")
    if any(folder.glob("*.safetensors")):
        return folder
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"model folder {folder} holds only pickle weights ({', '.join(pickles)}); "
            "loading them would run code: re-save with save_pretrained(safe_serialization=True)"
        )
    raise ModelLoadError(f"model folder {folder} has no *.safetensors weights; save it with save_pretrained")


def check_gguf(path: Path) -> Path:
    """A readable GGUF file, or a one-line reason it is not."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes); pass a .gguf model file")
    return path


def gguf_to_folder(path: Path) -> Path:
    """Dequantize a GGUF file to float32 safetensors once; later calls reuse the cache.

    The cache folder is keyed by the file's sha256 and written atomically (temporary
    folder, then rename), so an interrupted conversion leaves nothing half-written.
    """
    check_gguf(path)
    key = sha256_of(path)
    target = cache_root() / "gguf" / key
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    for needed in ("gguf", "accelerate"):
        try:
            __import__(needed)
        except ImportError:
            raise ModelLoadError(
                f"loading {path.name} needs the package {needed!r}: pip install {needed}"
            ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
    except Exception as error:  # transformers raises many kinds here
        raise ModelLoadError(f"transformers could not read GGUF file {path}: {first_line(error)}") from None
    # the GGUF tensors are already dequantized: save the folder as plain float32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tokenizer.save_pretrained(staging)
        except Exception:  # a GGUF file without a usable tokenizer: ids only
            pass
        staging.chmod(0o755)
        (staging / "SOURCE.json").write_text(json.dumps({"gguf": path.name, "sha256": key}))
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _hub_cache_folder(repo_id: str) -> Path | None:
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
        cached = _hub_cache_folder(text)
        if cached is not None:
            return ModelSource(text, "cache", check_folder(cached), cached)
    from .named import NAMED_MODELS

    raise ModelLoadError(
        f"model {text!r} not found: not a folder, a .gguf file, a named model "
        f"({', '.join(NAMED_MODELS)}), or an id in the local Hugging Face cache"
    )
