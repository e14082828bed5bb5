"""The commit log: one checksummed JSON line per commit, appended under ``fcntl.flock``, written last.

A group exists for readers only once its line is complete and its checksum matches, so a writer killed
at any point leaves either a whole group or nothing visible. Records get consecutive sequence numbers
(the order of the lines), which define the global row order of the store.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from rbpipe.system.fsutil import file_lock


def _dumps(record: dict) -> bytes:
    """Compact JSON with sorted keys. orjson writes the same bytes as ``json.dumps`` many times faster (a
    group's record carries its catalogue lists), except that it writes NaN/Infinity as ``null``: a ``null``
    that does not read back as the record's own ``None`` sends the record through ``json`` instead, so
    values round-trip exactly."""
    try:
        body = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
        if b"null" not in body or orjson.loads(body) == record:
            return body
    except TypeError:  # e.g. a key or value orjson does not serialise
        pass
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode()


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:  # NaN / Infinity tokens, which only json reads
        return json.loads(body)


def encode(record: dict) -> bytes:
    body = _dumps(record)
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode(line: bytes) -> dict | None:
    """Parse one line; None when it is torn (bad checksum or JSON)."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        return _loads(body)
    except ValueError:
        return None


class CommitLog:
    """Incremental reader and locked appender of ``commits.jsonl``."""

    def __init__(self, path: str | os.PathLike, *, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self._refused: OSError | None = None
        try:
            self._fd = (os.open(self.path, os.O_RDONLY) if read_only else
                        os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as err:  # a read-only store (file system or permissions) is still readable
            if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not self.path.exists():
                raise
            self._fd = os.open(self.path, os.O_RDONLY)
            self.read_only = True
            self._refused = err  # why it is read-only: a write says so (EACCES is not a read-only file system)
        self._offset = 0
        self.next_seq = 0
        self.torn_lines = 0  # complete lines that failed their checksum (a writer died mid-line)
        self.pending_bytes = 0  # an unterminated tail (being written now, or torn)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_new(self) -> list[dict]:
        """Records appended since the last call (cheap when nothing changed: one fstat)."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return []
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1
        self.pending_bytes = len(data) - end
        out = []
        for line in data[:end].split(b"\n")[:-1]:
            rec = decode(line)
            if rec is None:
                self.torn_lines += 1
                continue
            out.append(rec)
            self.next_seq = rec["seq"] + 1
        self._offset += end
        return out

    def locked(self):
        """The commit-log lock (an exclusive ``flock`` on the log's own descriptor)."""
        return file_lock(self._fd)

    def append(self, make: Callable[[int], dict | None], apply: Callable[[list[dict]], Any]) -> dict | None:
        """Under the lock: catch up (``apply`` the new records), build the record for the next sequence
        number with ``make`` (which may raise: nothing is written), and write it as one line."""
        if self.read_only:
            why = self._refused
            raise OSError(why.errno if why is not None else errno.EROFS,
                          f"{self.path} was opened read-only" + (f" ({why.strerror})" if why is not None else ""),
                          str(self.path))
        with self.locked():
            apply(self.read_new())
            if self.pending_bytes:  # a dead writer's torn tail: terminate it so it reads as one bad line
                os.write(self._fd, b"\n")
                self.read_new()
            rec = make(self.next_seq)
            if rec is None:
                return None
            rec["seq"] = self.next_seq
            line = encode(rec)
            if os.write(self._fd, line) == len(line) and not self.pending_bytes:
                # under the lock nobody else appends: the file now ends with exactly this line, so it is
                # applied as it reads back (decoded from its JSON) without reading the file again
                self._offset += len(line)
                self.next_seq += 1
                apply([_loads(line[9:-1])])
            else:
                apply(self.read_new())
            return rec
