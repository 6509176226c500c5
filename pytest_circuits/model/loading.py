"""Find a model's weights offline and safely: folders, cache ids, GGUF files, named models.

Every source resolves to a folder in the ``save_pretrained`` layout with safetensors
weights; a GGUF file is dequantized to float32 once and cached as safetensors,
keyed by the file's sha256. Pickle weights are refused: unpickling runs code.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import CircuitsError, FileSystemError, ModelLoadError, first_line, one_line
from ..fsio import (
    OWNER_FILE,
    JsonUnreadable,
    atomic_write_text,
    ensure_dir,
    fs_error,
    fsync_dir,
    make_staging_dir,
    parse_json,
    read_json,
    remove_stale_staging,
)
from ..options import flag
from .named import named_model_path


def warn(text: str) -> None:
    """One warning line on stderr (the run goes on)."""
    print(f"pytest-circuits: warning: {text}", file=sys.stderr)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFETENSORS_SUFFIX = ".safetensors"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
GGUF_MAGIC = b"GGUF"
MARKER = "COMPLETE.json"  # written last into a conversion cache entry
STAGING_PREFIX = ".staging-"
STAGING_MAX_AGE_S = 6 * 3600.0  # a staging folder whose owner cannot be checked is stale after this


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
    """Hex sha256 of a file's bytes (hashed once per process per file state: path, size, mtime)."""
    stat = os.stat(path)
    return _sha256_cached(str(path), stat.st_size, stat.st_mtime_ns, chunk)


@lru_cache(maxsize=256)
def _sha256_cached(path: str, size: int, mtime_ns: int, chunk: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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


# ---------------------------------------------------------------- GGUF files and their conversion cache


def check_gguf(path: Path) -> Path:
    """A readable GGUF file, or a one-line reason it is not."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise fs_error(error, path, "read") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes); pass a .gguf model file")
    return path


def dequantizable_types() -> set[str] | None:
    """Names of the GGUF tensor types the ``gguf`` package can dequantize (None: cannot tell)."""
    try:
        from gguf import quants
    except ImportError:
        return None
    traits = getattr(quants, "_type_traits", None)
    if not isinstance(traits, dict):
        return None
    return {"F32", "F16"} | {t.name for t in traits}


def check_gguf_tensors(path: Path) -> None:
    """Refuse a GGUF file that is damaged or holds a tensor type that cannot be dequantized, in one line."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(f"loading {path.name} needs the package 'gguf': pip install gguf") from None
    try:
        tensors = GGUFReader(str(path)).tensors
    except Exception as error:  # the reader raises ValueError, IndexError, struct errors on damage
        raise ModelLoadError(
            f"GGUF file {path} is damaged or truncated ({first_line(error)}); download or export it again"
        ) from None
    known = dequantizable_types()
    if known is None:
        return
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if kind not in known:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {tensor.name} has type {kind}, which cannot be dequantized here; "
                f"export the model with one of {', '.join(sorted(known))}"
            )


def gguf_to_folder(path: Path) -> Path:
    """Dequantize a GGUF file to float32 safetensors once; later calls reuse the verified cache.

    The entry ``<cache>/gguf/<sha256 of the file>`` is written in a staging folder (its owner pid
    recorded), ends with ``COMPLETE.json`` (size and sha256 of every file), then is renamed into
    place. On use the marker is checked and a bad entry rebuilt; staging folders left by killed
    runs are removed. An unusable cache folder falls back to a temporary one with a warning line.
    """
    path = Path(path)
    check_gguf(path)
    check_gguf_tensors(path)
    key = sha256_of(path)
    convert = _Converter(path, key)
    primary = cache_root() / "gguf"
    try:
        return _cached_conversion(primary, convert)
    except FileSystemError as error:
        fallback = _temporary_cache()
        try:
            folder = _cached_conversion(fallback, convert)
        except FileSystemError as second:
            raise FileSystemError(f"{error}; the temporary folder failed too: {second}") from None
        warn(
            f"GGUF cache unusable ({error}); converted {path.name} into the temporary folder {fallback} "
            "instead (set PYTEST_CIRCUITS_CACHE to a writable folder to keep it)"
        )
        return folder


def quiet_transformers() -> None:
    """No progress bars or info lines from transformers: stderr carries only our own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class _Converter:
    """Loads the GGUF file through transformers once and saves it into a staging folder."""

    def __init__(self, path: Path, key: str):
        self.path, self.key, self._model = path, key, None

    def model(self):
        if self._model is None:
            for needed in ("gguf", "accelerate"):
                try:
                    __import__(needed)
                except ImportError:
                    raise ModelLoadError(
                        f"loading {self.path.name} needs the package {needed!r}: pip install {needed}"
                    ) from None
            import torch
            from transformers import AutoModelForCausalLM

            quiet_transformers()
            try:
                with contextlib.redirect_stderr(io.StringIO()):  # its own tqdm bar, outside transformers' switch
                    model, info = AutoModelForCausalLM.from_pretrained(
                        str(self.path.parent),
                        gguf_file=self.path.name,
                        dtype=torch.float32,
                        local_files_only=True,
                        output_loading_info=True,
                    )
            except Exception as error:  # transformers raises many kinds here
                raise ModelLoadError(
                    f"transformers could not read GGUF file {self.path}: {first_line(error)}"
                ) from None
            from .checkpoint_keys import check_loading_info

            check_loading_info(info, f"GGUF file {self.path}")  # a tensor missing from the file: not a random init
            # the GGUF tensors are already dequantized: save the folder as plain float32
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            self._model = model
        return self._model

    def save(self, staging: Path) -> None:
        from transformers import AutoTokenizer

        self.model().save_pretrained(staging, safe_serialization=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            tokenizer.save_pretrained(staging)
        except Exception:  # a GGUF file without a usable tokenizer: ids only
            pass
        (staging / "SOURCE.json").write_text(json.dumps({"gguf": self.path.name, "sha256": self.key}))


def _cached_conversion(root: Path, convert: _Converter) -> Path:
    ensure_dir(root)
    remove_stale_staging(root, ".", STAGING_MAX_AGE_S)  # every dot-folder here is a staging folder
    target = root / convert.key
    if target.exists():
        problem = cache_entry_problem(target)
        if problem is not None and adopt_legacy_entry(target, convert):
            problem = cache_entry_problem(target)
        if problem is None:
            return target
        warn(f"GGUF cache entry {target} is bad ({problem}); rebuilding it")
        _discard(target, root)
    convert.model()  # a GGUF read error is the file's fault, not the cache's: raise it before staging
    staging = make_staging_dir(root, f"{STAGING_PREFIX}{convert.key[:16]}.")
    try:
        try:
            convert.save(staging)
            (staging / OWNER_FILE).unlink()
            write_marker(staging, convert)
            staging.chmod(0o755)
        except CircuitsError:
            raise
        except Exception as error:  # OSError, or safetensors' own error wrapping one (disk full)
            raise FileSystemError(
                f"cannot write the converted {convert.path.name} into {root}: {first_line(error)}; "
                "free space there or set PYTEST_CIRCUITS_CACHE to a writable folder"
            ) from None
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if cache_entry_problem(target) is not None:
                raise FileSystemError(f"cannot move the converted GGUF into {target}; remove that folder") from None
        fsync_dir(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_marker(folder: Path, convert: _Converter) -> None:
    """``COMPLETE.json``, written last: size and sha256 of every file of a finished conversion."""
    files = {}
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name != MARKER:
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
            files[file.name] = {"size": file.stat().st_size, "sha256": sha256_of(file)}
    marker = {"format": 1, "gguf": convert.path.name, "sha256": convert.key, "files": files}
    atomic_write_text(folder / MARKER, json.dumps(marker, indent=1, sort_keys=True))


def cache_entry_problem(folder: Path) -> str | None:
    """Why a conversion cache entry cannot be used (no marker, a file missing, truncated or changed), or None."""
    try:
        files = read_json(folder / MARKER)["files"]
        expected = {str(name): (int(v["size"]), str(v["sha256"])) for name, v in files.items()}
    except JsonUnreadable as error:
        return f"no {MARKER}: the conversion never finished" if error.missing else f"{MARKER} {error.reason}"
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{MARKER} is unreadable ({first_line(error)})"
    if "config.json" not in expected or not any(n.endswith(SAFETENSORS_SUFFIX) for n in expected):
        return f"{MARKER} lists no config.json or weights"
    for name, (size, digest) in expected.items():
        file = folder / name
        try:
            actual = file.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} expected"
        if sha256_of(file) != digest:
            return f"{name} changed since the conversion"
    unlisted = [p.name for p in folder.glob("*" + SAFETENSORS_SUFFIX) if p.name not in expected]
    if unlisted:
        return f"{', '.join(unlisted)} not in {MARKER}"
    return None


def safetensors_complete(file: Path) -> bool:
    """True when a safetensors file is as long as its header says: ``8 + header + max end offset`` bytes."""
    try:
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = parse_json(handle.read(size), file)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return file.stat().st_size == 8 + size + max(ends, default=0)
    except (OSError, JsonUnreadable, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def adopt_legacy_entry(target: Path, convert: _Converter) -> bool:
    """Give an entry written before ``COMPLETE.json`` existed its marker, when it is whole.

    Such entries were renamed into place only after a complete save; whole means its
    ``SOURCE.json`` names this file's sha256 and every safetensors file is as long as its
    header says (`safetensors_complete`). Returns True when the marker was written.
    """
    if (target / MARKER).exists():
        return False
    try:
        source = read_json(target / "SOURCE.json")
    except JsonUnreadable:
        return False
    weights = list(target.glob("*" + SAFETENSORS_SUFFIX))
    if not isinstance(source, dict) or source.get("sha256") != convert.key or not weights:
        return False
    if not (target / "config.json").is_file() or not all(safetensors_complete(f) for f in weights):
        return False
    try:
        write_marker(target, convert)
    except (FileSystemError, OSError):
        return False
    return True


def _discard(target: Path, root: Path) -> None:
    """Move a bad entry aside (readers never see half of it), then delete it."""
    aside = root / f"{STAGING_PREFIX}bad-{target.name[:16]}.{os.getpid()}"
    try:
        target.rename(aside)
    except OSError:
        aside = target
    shutil.rmtree(aside, ignore_errors=True)


@lru_cache(maxsize=1)
def _temporary_cache() -> Path:
    """A private temporary conversion cache for this process, removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="pytest-circuits-cache-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


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
        f"model {text!r} not found: not a folder, a .gguf file, a named model "
        f"({', '.join(NAMED_MODELS)}), or an id in the local Hugging Face cache"
    )


def read_config(folder, trust_remote_code: bool = False, what: str | None = None):
    """The transformers config of a weights folder; an unknown architecture, or a config transformers'
    own checks refuse (``StrictDataclassFieldValidationError``, ``TypeError``, ``ZeroDivisionError``), is one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise ModelLoadError(
            f"model {what or str(folder)!r}: {first_line(error)} (pass {flag('trust-remote-code')} only if you trust it)"
        ) from None
    except Exception as error:
        raise ModelLoadError(
            f"model {what or str(folder)!r}: transformers refuses its config.json ({type(error).__name__}: "
            f"{one_line(error)}); fix config.json or save the model again"
        ) from None
