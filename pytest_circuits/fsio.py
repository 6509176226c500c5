"""Every file and folder we write, and every JSON file others wrote that we read, behind one
layer that turns OS and parse errors into one line.

``atomic_write_text``: temporary file in the target's folder, ``fsync``, ``os.replace``,
``fsync`` of the folder; on any failure (disk full included) the temporary file is removed
and the old file stays byte-identical; a symbolic link is never written through (`check_output`,
docs/safety.md). ``ensure_dir``: a folder that exists and can be
written, or a `FileSystemError` naming the path and the fix. ``remove_stale`` cleans the
temporary files and staging folders that a killed process left behind. ``read_json``: the
one reader of JSON we did not write (baselines, ``config.json``, indexes, markers): regular
files only (a FIFO never blocks), at most ``JSON_MAX_BYTES``, at most ``JSON_MAX_DEPTH`` levels
deep, every failure a `JsonUnreadable` whose ``reason`` completes "FILE ...".
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import unicodedata
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from .errors import FileSystemError

T = TypeVar("T")

TEMP_SUFFIX = ".tmp"
JSON_MAX_BYTES = 256 * 2**20  # a baseline of an 80-layer, 64-head model is about 30 MB
JSON_MAX_DEPTH = 64  # our records nest 5 levels, model configs fewer than 10
OWNER_FILE = "OWNER.json"  # in a staging folder: the pid and host writing it


def os_error_line(error: OSError, path: str | os.PathLike, action: str) -> str:
    """One line: what failed on which path, why (errno), and what to do about it."""
    path = Path(path)
    code = error.errno
    if code in (errno.EACCES, errno.EPERM):
        why, fix = (
            "permission denied",
            f"make {path.parent if not path.is_dir() else path} writable or choose another folder",
        )
    elif code == errno.EROFS:
        why, fix = "the file system is read-only", "choose a folder on a writable file system"
    elif code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        why, fix = (
            "no space left (disk full, quota or file size limit)",
            "free space on that device or choose another folder",
        )
    elif code == errno.ENOTDIR or code == errno.EEXIST:
        why, fix = "a file is in the way of a folder on that path", "move the file away or choose another folder"
    elif code == errno.EISDIR:
        why, fix = "that path is a folder", "pass a file path"
    elif code == errno.ENOENT:
        why, fix = "a parent folder is missing", "create the parent folder or choose another path"
    else:
        why, fix = error.strerror or type(error).__name__, "check the path"
    return f"cannot {action} {path}: {why} (errno {code}); {fix}"


def fs_error(error: OSError, path, action: str) -> FileSystemError:
    """A `FileSystemError` carrying `os_error_line`."""
    return FileSystemError(os_error_line(error, path, action))


def ensure_dir(path: str | os.PathLike) -> Path:
    """``path`` as an existing folder (parents created), or a one-line `FileSystemError`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileSystemError(f"cannot use {path} as a folder: it is a file; move it away or choose another folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise fs_error(error, path, "create the folder") from None
    return path


def fsync_dir(folder: str | os.PathLike) -> None:
    """``fsync`` a folder so a rename in it survives a crash (best effort: some systems refuse)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


STREAM_FOLDERS = ("/dev", "/dev/fd", "/proc/self/fd")  # the system's names of a process's streams (/dev/stdout)


def check_output(path: str | os.PathLike) -> Path:
    """``path`` if a file may be written there (`atomic_write_bytes`' rule), else a one-line `FileSystemError`.

    A symbolic link is never written through: a link planted in a folder (git stores links) could
    name any file the process can write. The one exception is a link the system keeps in
    `STREAM_FOLDERS` (``/dev/stdout``, ``/dev/fd/1``): a stream, written through, nothing replaced. Writers call this before any work, so a refused path ends the command at once.
    """
    path = Path(path)
    try:
        info = os.lstat(path)
    except OSError:
        return path
    if stat.S_ISDIR(info.st_mode):
        raise FileSystemError(f"cannot write {path}: it is a folder; pass a file path")
    if stat.S_ISLNK(info.st_mode) and not _stream_link(path):
        raise FileSystemError(
            f"cannot write {path}: it is a symbolic link (to {os.readlink(path)}), and a link is never written "
            "through (it could name any file); remove the link, or link its folder instead"
        )
    return path


def _stream_link(path: Path) -> bool:
    """True for a link the system keeps in `STREAM_FOLDERS` (``/dev/stdout``: whatever the stream is)."""
    try:
        folder = os.path.realpath(path.absolute().parent)
    except OSError:
        return False
    return folder in {os.path.realpath(f) for f in STREAM_FOLDERS}


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` so readers see the whole old or the whole new file, never a part.

    Only a regular file (or no file) is replaced by a rename; a symbolic link is refused
    (`check_output`: nothing is written). A device or FIFO (a named pipe, ``/dev/stdout``) is
    written through instead (`write_through`).
    """
    path = Path(path)
    ensure_dir(path.parent)
    check_output(path)
    try:
        info = os.lstat(path)
    except OSError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):  # a device, FIFO or stream link
        return write_through(path, data)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    except OSError as error:
        raise fs_error(error, path, "write") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as error:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise fs_error(error, path, "write") from None
        raise
    fsync_dir(path.parent)
    return path


def write_through(path: Path, data: bytes) -> Path:
    """Write ``data`` into what ``path`` names (a device or FIFO, or ``/dev/stdout``), never
    replacing it; opening never blocks (a FIFO no process reads is a one-line error, not a hang)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if error.errno == errno.ENXIO:
            raise FileSystemError(
                f"cannot write {path}: no process reads that FIFO or socket; start the reader first or pass a file path"
            ) from None
        raise fs_error(error, path, "write") from None
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as error:
        raise fs_error(error, path, "write") from None
    finally:
        os.close(fd)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8", errors: str = "strict") -> Path:
    """`atomic_write_bytes` of ``text`` encoded (UTF-8 by default; ``errors`` as in `str.encode`)."""
    return atomic_write_bytes(path, text.encode(encoding, errors))


def is_temp_name(name: str, target: str | None = None) -> bool:
    """True for a name `atomic_write_bytes` gives its temporary files (of ``target`` when given)."""
    prefix = f".{target}." if target else "."
    return name.startswith(prefix) and name.endswith(TEMP_SUFFIX)


def remove_stale_temps(folder: str | os.PathLike, older_than_s: float = 600.0, target: str | None = None) -> list[Path]:
    """Remove ``.NAME.XXXX.tmp`` files older than ``older_than_s`` in ``folder`` (only those of the file
    ``target`` when given: a user's folder may hold other programs' temporary files); returns those removed.

    A live writer's temporary file lives milliseconds, so the age threshold never
    races a writer; an unreadable folder is left alone (the write reports it).
    """
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            if is_temp_name(entry.name, target) and entry.is_file() and now - entry.stat().st_mtime > older_than_s:
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue
    return removed


def make_staging_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A fresh staging folder in ``parent`` recording its owner (pid, host) for `staging_is_stale`."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        (staging / OWNER_FILE).write_text(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        )
    except OSError as error:
        raise fs_error(error, parent, "create a staging folder in") from None
    return staging


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except OSError:
        return False
    return True


def staging_is_stale(staging: Path, max_age_s: float) -> bool:
    """True when no live process owns ``staging``: its recorded owner on this host is dead,
    or it is older than ``max_age_s`` (owner unknown, or on another host)."""
    try:
        age = time.time() - staging.stat().st_mtime
    except OSError:
        return False
    try:
        owner = json.loads((staging / OWNER_FILE).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return age > max_age_s
    if host == socket.gethostname() and pid != os.getpid():
        return not _pid_alive(pid) or age > max_age_s
    return age > max_age_s


def remove_stale_staging(parent: str | os.PathLike, prefix: str, max_age_s: float) -> list[Path]:
    """Remove the staging folders ``parent/<prefix>*`` that `staging_is_stale` calls stale."""
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix) and entry.is_dir() and staging_is_stale(entry, max_age_s):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


# ---------------------------------------------------------------- reading JSON others wrote


class JsonUnreadable(Exception):
    """A JSON file we cannot use: ``reason`` completes "PATH ..." (``"is not valid JSON (line 3)"``)."""

    def __init__(self, path: str | os.PathLike, reason: str, missing: bool = False):
        super().__init__(f"{path} {reason}")
        self.path, self.reason, self.missing = Path(path), reason, missing


def parse_json(data: bytes | str, path: str | os.PathLike = "JSON") -> Any:
    """``json.loads`` of ``data`` with every way it can fail as a `JsonUnreadable` (not UTF-8, not JSON,
    nested past `JSON_MAX_DEPTH` or the recursion limit, a number past Python's 4300 digits)."""

    def fail(reason: str):
        return JsonUnreadable(path, reason)

    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise fail("is not UTF-8 text (a binary file?)") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise fail(f"is not valid JSON (line {error.lineno})") from None
    except RecursionError:
        raise fail(f"nests deeper than {JSON_MAX_DEPTH} levels") from None
    except ValueError as error:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise fail(f"holds a value Python cannot read ({' '.join(str(error).split())})") from None
    if _depth_beyond(value, JSON_MAX_DEPTH):
        raise fail(f"nests deeper than {JSON_MAX_DEPTH} levels")
    return value


def _depth_beyond(value, limit: int) -> bool:
    """True when ``value`` nests lists and objects more than ``limit`` levels deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def read_json(path: str | os.PathLike, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """The JSON value in the regular file ``path``, or a `JsonUnreadable` saying why not (one line).

    Opened without blocking (a FIFO or device is refused, never waited on); larger than
    ``max_bytes``, refused before it is read; then `parse_json`.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise JsonUnreadable(path, "does not exist", missing=True) from None
    except IsADirectoryError:
        raise JsonUnreadable(path, "is a folder, not a file") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise JsonUnreadable(path, "is a symbolic link loop (or a path through one)") from None
        if error.errno == errno.ENAMETOOLONG:
            raise JsonUnreadable(path, "has a name longer than the system allows") from None
        raise JsonUnreadable(path, f"cannot be read ({error.strerror or type(error).__name__})") from None
    info = os.fstat(fd)  # before fdopen, which raises IsADirectoryError on a folder
    if stat.S_ISDIR(info.st_mode):
        os.close(fd)
        raise JsonUnreadable(path, "is a folder, not a file")
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(info.st_mode):
            raise JsonUnreadable(path, "is not a regular file (a FIFO, device or socket)")
        if info.st_size > max_bytes:
            raise JsonUnreadable(path, f"holds {info.st_size} bytes, more than the {max_bytes} a JSON file may")
        try:
            data = handle.read(max_bytes + 1)
        except OSError as error:
            raise JsonUnreadable(path, f"cannot be read ({error.strerror or type(error).__name__})") from None
    if len(data) > max_bytes:
        raise JsonUnreadable(path, f"holds more than the {max_bytes} bytes a JSON file may")
    return parse_json(data, path)


def safe_name(text: str) -> str:
    """A file-name-safe form of a model name: letters (any script), digits, ``.``, ``_``, ``-``.

    Anything else becomes ``_``; when that changed the name, a short hash of the original is
    appended, so two names that differ only in such characters never share a baseline.
    """
    original = unicodedata.normalize("NFC", str(text))
    cleaned = re.sub(r"[^\w.-]+", "_", original).strip("._") or "model"
    if cleaned == original:
        return cleaned
    return f"{cleaned}-{hashlib.sha256(original.encode()).hexdigest()[:8]}"


class RunFolder:
    """The folder every process of one run shares (pytest-xdist): file locks and results computed once per run."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def once(self, name: str, compute: Callable[[], T], dump: Callable[[T], str], load: Callable[[str], T]) -> T:
        """``compute()`` once per run, however many processes ask: under the file lock ``name.lock``
        the first process computes it and writes ``dump(value)`` atomically to the file ``name``;
        every later one (this process or another) finds the file and returns ``load(its text)``."""
        from filelock import FileLock

        path = self.path / name
        with FileLock(str(self.path / f"{name}.lock")):
            if path.exists():
                return load(path.read_text(encoding="utf-8"))
            value = compute()
            atomic_write_text(path, dump(value))
            return value


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


def read_utf8(path: Path, said: str, what: str, error: type[Exception], limit: int, split: str) -> tuple[bytes, str]:
    """``(bytes, text)`` of the UTF-8 file at ``path`` (a user's ``what``, named by the flag ``said``),
    or one line of ``error`` naming the file and the fix: missing, a folder, unreadable, over
    ``limit`` bytes (``split``: what to do then), or not UTF-8 (with the line of the first bad byte)."""
    try:
        if path.stat().st_size > limit:
            raise error(f"{said} {path}: over {limit >> 20} MiB; {split}")
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{said} {path}: no such file; give the path of {what}") from None
    except IsADirectoryError:
        raise error(f"{said} {path} is a folder; give the path of {what}") from None
    except OSError as failure:
        raise error(f"{said} {path} cannot be read ({failure.strerror}); check it") from None
    try:
        return data, data.decode("utf-8")
    except UnicodeDecodeError as failure:
        line = data[: failure.start].count(b"\n") + 1
        raise error(f"{said} {path}:{line}: not UTF-8 text; save it as UTF-8") from None
