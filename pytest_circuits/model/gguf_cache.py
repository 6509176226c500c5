"""GGUF files and their conversion cache.

A GGUF file is checked (magic bytes, every tensor type dequantizable), loaded through
transformers once, dequantized to float32 and cached as safetensors under
``<cache>/gguf/<sha256 of the file>``: written in a staging folder, sealed by ``COMPLETE.json``
(size and sha256 of every file), renamed into place, verified on every use.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from ..errors import CircuitsError, FileSystemError, ModelLoadError, first_line, warn
from ..fsio import (
    OWNER_FILE,
    JsonUnreadable,
    atomic_write_text,
    cache_root,
    ensure_dir,
    fs_error,
    fsync_dir,
    make_staging_dir,
    parse_json,
    read_json,
    remove_stale_staging,
    sha256_of,
)
from ..progress import phase

SAFETENSORS_SUFFIX = ".safetensors"
GGUF_MAGIC = b"GGUF"
MARKER = "COMPLETE.json"  # written last into a conversion cache entry
STAGING_PREFIX = ".staging-"
STAGING_MAX_AGE_S = 6 * 3600.0  # a staging folder whose owner cannot be checked is stale after this


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
    """Refuse a GGUF file that is damaged or holds a tensor type that cannot be dequantized, in one line;
    checked once per process per file state (path, size, mtime), as `fsio.sha256_of` hashes: reading a
    GGUF file's fields takes seconds (SmolLM2's vocabulary), and every run of a process resolves its model."""
    stat = os.stat(path)
    _check_gguf_tensors(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _check_gguf_tensors(name: str, size: int, mtime_ns: int) -> None:
    path = Path(name)
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
    # a minute or so for a 135M model on a shared CPU: a heartbeat line meanwhile, never silence
    with phase(f"converting {convert.path.name} to float32 safetensors, once (cached in {root})"):
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
