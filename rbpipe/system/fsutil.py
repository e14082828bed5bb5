"""File-system idioms every on-disk part of rbpipe needs, written once.

* :func:`atomic_write`: a file appears whole or not at all (temporary name in the same directory, optional
  ``fsync``, then ``rename``, or ``link`` when an existing file must win). Readers that glob or open the
  final name never see half a file, and a writer killed midway leaves at most a dot-named temporary.
* :func:`file_lock`: an exclusive ``fcntl.flock`` on a path (created if absent) or on an open descriptor,
  released by the kernel when its holder dies, so a crashed process never leaves a lock behind.

Every write of a store goes through :func:`atomic_write`, or :func:`write_file` (its first half) for a
compaction's output (the commit log's appends aside: one ``write`` of one checksummed line).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: what :func:`atomic_write` writes: bytes, or a function that writes the temporary file at the path given
Content = bytes | str | Callable[[str], None]


def atomic_write(path: str | os.PathLike, content: Content, *, fsync: bool = True, replace: bool = True,
                 tmp_name: str | None = None) -> bool:
    """Write ``content`` to ``path`` so that ``path`` holds either its old content or all of the new one.

    ``content`` is bytes/str, or a callable that writes the file at the temporary path it is given (e.g.
    ``lambda tmp: pq.write_table(table, tmp)``). ``fsync`` flushes the data to disk before the rename (a
    power cut then cannot leave an empty file under the final name). ``replace=False`` keeps an existing
    ``path`` (``link`` instead of ``rename``: the first of concurrent creators wins) and returns False when
    one was there. The temporary file (``tmp_name``, default ``.<name>.<pid>.tmp`` beside ``path``) is
    removed on any failure.

    Examples:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> atomic_write(d / "a.json", b'{"x": 1}')
        True
        >>> atomic_write(d / "a.json", b'{"x": 2}', replace=False)  # the existing file wins
        False
        >>> (d / "a.json").read_bytes()
        b'{"x": 1}'
    """
    path = Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}.tmp")
    write_file(tmp, content, fsync=fsync)
    try:
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file(path: str | os.PathLike, content: Content, *, fsync: bool = True) -> None:
    """Write ``content`` (as for :func:`atomic_write`) to ``path`` and, with ``fsync``, flush it to disk; the
    file is removed on any failure. The first half of :func:`atomic_write`, for a writer that must publish the
    file later (a compaction writes its output without holding the store's maintenance lock, then renames it
    under the lock)."""
    try:
        if callable(content):
            content(str(path))
        else:
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


@contextmanager
def file_lock(target: str | os.PathLike | int, *, blocking: bool = True) -> Iterator[bool]:
    """``with file_lock(path_or_fd) as held:`` an exclusive ``flock`` for the block.

    A path is opened (created if absent) for the duration; a descriptor is locked as is (its owner closes
    it). With ``blocking=False`` the block runs at once with ``held`` False when another process holds the
    lock; otherwise ``held`` is True.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / ".lock"
        >>> with file_lock(p) as held:
        ...     held
        True
    """
    if isinstance(target, int):
        own, fd = False, target
    else:
        own, fd = True, os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            if not own:  # closing the descriptor releases its lock; a borrowed one is unlocked explicitly
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        if own:
            os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False, **dumps_kwargs: Any) -> None:
    """:func:`atomic_write` of ``obj`` as JSON. No ``fsync`` by default: run-state files (pids, endpoint, the
    coordinator's share-out, rewritten at every hand-over) must be whole, and may be a moment old after a
    power cut."""
    atomic_write(path, json.dumps(obj, **dumps_kwargs), fsync=fsync)
