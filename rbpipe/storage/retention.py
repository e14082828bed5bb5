"""What retention keeps on disk, and the bookkeeping that lets evictors delete the rest.

Evicting a group only appends an ``evict`` record; its bytes are freed when the file holding them holds no
live group and nobody will write into it again (docs/FORMAT.md, "Retention and disk"). The bound that gives,
with ``L`` the live bytes, ``G`` the largest live group and ``W`` the writer processes:

* Arrow: segment files hold at most ``2 L + (W + 1) (R + G)`` bytes plus one file-system block per file,
  where ``R = max(ROLL_MIN, L / ROLL_FRACTION)`` is the size at which a writer seals its segment and starts
  another (one partly evicted segment per writer plus the in-progress one, and the last ``compact()``
  output, at most ``L`` when it was written).
* Zarr: chunk files are those holding a live group plus at most two per writer process and array (the one
  holding its oldest live group and the one it is filling), each at most the array's chunk size.
"""

from __future__ import annotations

import heapq
import os
import socket
from pathlib import Path

from rbpipe.storage.format import SEGMENTS_DIR, ZARR_DIR
from rbpipe.system.procs import pid_alive

ROLL_MIN = 256 * 1024  # smallest segment a writer seals when the store has retention
ROLL_FRACTION = 8  # ... else an eighth of the live bytes: few files, little dead space per writer
BLOCK = 4096  # file-system allocation unit assumed by the bound


def roll_bytes(live_bytes: int) -> int:
    """Segment size after which a writer of a store with retention seals its segment (its evicted groups
    can then be deleted with the file once none of them is live)."""
    return max(ROLL_MIN, live_bytes // ROLL_FRACTION)


def data_bytes(path: str | os.PathLike) -> int:
    """Bytes allocated on disk to group data (Arrow segments, Zarr chunks): sparse chunk files count only
    what was written. The commit log and catalogue (a small record per group ever committed) are not data."""
    total = 0
    for sub in (SEGMENTS_DIR, ZARR_DIR):
        for root, _, files in os.walk(Path(path) / sub):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def disk_bound(storage, writers: int) -> int:
    """The most :func:`data_bytes` may be for ``storage`` now, with ``writers`` writer processes (see top;
    each backend states its own: ``disk_bound``)."""
    storage._refresh()
    return storage._backend.disk_bound(writers)


def owner_alive(name: str) -> bool:
    """Whether the writer ``<host>-<pid>-<rand>`` may still write (always True for another host's)."""
    try:
        host, pid, _ = name.rsplit("-", 2)
        return host != socket.gethostname() or pid_alive(int(pid))
    except ValueError:
        return True


class ChunkLedger:
    """Which chunks of one family of Zarr arrays (the row arrays, or one ragged column's values) hold which
    committed groups, so that an evictor can delete a chunk once all of its groups are evicted and its only
    writer has moved past it or died (a chunk is only ever written by the process that reserved it).
    """

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.newest: dict[int, int] = {}  # chunk -> newest seq in it
        self.owner: dict[int, str] = {}  # chunk -> the writer that reserved it
        self.last: dict[str, int] = {}  # writer -> last chunk it committed into
        self._heap: list[tuple[int, int]] = []  # (newest seq, chunk), lazily stale
        self._waiting: list[int] = []  # dead chunks whose writer may still be filling them

    def add(self, seq: int, writer: str, start: int, size: int) -> None:
        """A committed group occupies positions ``start .. start + size`` (size >= 1)."""
        first, last = start // self.chunk, (start + max(size, 1) - 1) // self.chunk
        for k in range(first, last + 1):
            if k not in self.newest:
                heapq.heappush(self._heap, (seq, k))
            self.newest[k] = max(self.newest.get(k, -1), seq)
            if self.owner.setdefault(k, writer) != writer:
                self.owner[k] = ""  # never deleted: two writers claim it (should not happen)
        self.last[writer] = max(self.last.get(writer, -1), last)

    def candidates(self, evicted_upto: int) -> list[int]:
        """Chunks whose groups are all evicted and whose writer has moved past them or is dead (checked
        now: read the log again after this, then :meth:`confirm`)."""
        while self._heap and self._heap[0][0] <= evicted_upto:
            seq, k = heapq.heappop(self._heap)
            if k in self.newest:
                self._waiting.append(k) if self.newest[k] == seq else heapq.heappush(self._heap, (self.newest[k], k))
        out: list[int] = []
        keep: list[int] = []
        for k in self._waiting:
            if k not in self.newest:
                continue
            if self.newest[k] > evicted_upto:  # its writer committed into it again
                heapq.heappush(self._heap, (self.newest[k], k))
                continue
            owner = self.owner[k]
            done = owner and (self.last.get(owner, -1) > k or not owner_alive(owner))
            (out if done else keep).append(k)
        self._waiting = keep
        return out

    def confirm(self, ks: list[int], evicted_upto: int) -> list[int]:
        """Those of ``ks`` still without a live group (after the log was read again): forgotten, to delete."""
        out = []
        for k in ks:
            if self.newest[k] <= evicted_upto:
                out.append(k)
                del self.newest[k], self.owner[k]
            else:
                heapq.heappush(self._heap, (self.newest[k], k))
        return out
