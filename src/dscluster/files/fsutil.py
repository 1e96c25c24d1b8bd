"""Small file helpers: atomic writes and append-only JSON lines.

Anything a crash could leave half-written (configs, env files, authorized_keys copies,
checkpoint pointers, summaries) goes through `atomic_write_*`: write a temp file in the
same directory, fsync, rename over the target, fsync the directory. A reader, or the machine
after a power loss, sees the old file or the new one, never a mix (tests/unit/test_power_loss.py
kills writers with SIGKILL at random points). A crash can leave a `.NAME.*.tmp` beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from dscluster.errors import DsclusterError


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a power loss
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse to fsync a directory; the file itself is synced
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, mode: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode=mode)


class StorageFull(DsclusterError):
    """A write failed for lack of space or an I/O error (ENOSPC, EDQUOT, EIO): the message names the
    directory and its free space. Exit 1: the job failed, the input was fine."""


def free_space_text(path: str | os.PathLike) -> str:
    """'<dir> has 1.2 MB free' for the nearest existing folder of `path`."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    folder = p if p.is_dir() else p.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return f"{folder}: free space unknown"
    return f"{folder} has {free / 1e6:.1f} MB free"


def storage_error(path: str | os.PathLike, e: OSError, what: str) -> StorageFull:
    return StorageFull(f"cannot write {path} ({e.strerror or e}): {what}; {free_space_text(path)}")


class JsonlWriter:
    """Append-only JSON lines, flushed per record so a crash keeps what was written.

    One writer per file: the run directory's contract. A record the disk has no room for is taken
    back whole (the file is cut to where it was), so a full disk never leaves a torn line for the next
    record to run into; the write raises StorageFull naming the folder and its free space, and a later
    write tries again (records written once there is room again are whole).

    Threads may share a writer: each record is written whole. A record written with `final=True` is the
    file's last: later writes are dropped (a rank stopped by SIGTERM writes its `end` from a thread of its
    own while the main thread may still be logging steps; readers take the last line for how it ended).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._lock = threading.Lock()
        self._sealed = False

    def write(self, record: dict, *, final: bool = False) -> None:
        data = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        with self._lock:
            if self._sealed:
                return
            end = self._file.tell()
            try:
                self._file.write(data)
                self._file.flush()
            except OSError as e:
                self._rollback(end)
                raise storage_error(self.path, e, "record not written, earlier records kept") from None
            self._sealed = final

    def _rollback(self, end: int) -> None:
        """Drop what Python buffered of the failed record and cut the file back to `end`."""
        try:
            self._file.close()  # flushes the buffer again, fails again, and closes the file all the same
        except OSError:
            pass
        try:
            os.truncate(self.path, end)
        except OSError:
            pass
        self._file = open(self.path, "ab")

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read JSON lines, tolerating a torn last line (a crashed writer)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
