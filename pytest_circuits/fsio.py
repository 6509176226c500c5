"""Every file and folder we write, behind one layer that turns OS errors into one line.

``atomic_write_text``: temporary file in the target's folder, ``fsync``, ``os.replace``,
``fsync`` of the folder; on any failure (disk full included) the temporary file is removed
and the old file stays byte-identical. ``ensure_dir``: a folder that exists and can be
written, or a `FileSystemError` naming the path and the fix. ``remove_stale`` cleans the
temporary files and staging folders that a killed process left behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from .errors import FileSystemError

TEMP_SUFFIX = ".tmp"
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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` so readers see the whole old or the whole new file, never a part."""
    path = Path(path)
    ensure_dir(path.parent)
    if path.is_dir():
        raise FileSystemError(f"cannot write {path}: it is a folder; pass a file path")
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


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """`atomic_write_bytes` of ``text`` encoded (UTF-8 by default)."""
    return atomic_write_bytes(path, text.encode(encoding))


def is_temp_name(name: str, target: str | None = None) -> bool:
    """True for a name `atomic_write_bytes` gives its temporary files (of ``target`` when given)."""
    prefix = f".{target}." if target else "."
    return name.startswith(prefix) and name.endswith(TEMP_SUFFIX)


def remove_stale_temps(folder: str | os.PathLike, older_than_s: float = 600.0) -> list[Path]:
    """Remove ``.NAME.XXXX.tmp`` files older than ``older_than_s`` in ``folder``; returns those removed.

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
            if is_temp_name(entry.name) and entry.is_file() and now - entry.stat().st_mtime > older_than_s:
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
