"""``StateJournal``: a small JSON state saved on every change for the price of one ``write``.

The coordinator saves its share-out of prompts at every hand-over (twice per learner step by default). A
write-then-rename of a small file is costly on ext4 (the rename over an existing file starts writeback of the
new one), a visible part of each learner step in the grouping manager under load; appending one line to an
open file costs next to nothing (figures: docs/DESIGN.md, Figures behind code choices). So a state is kept as two files:

* ``NAME`` (e.g. ``prompts.json``), a snapshot written atomically (:func:`rbpipe.system.fsutil.atomic_write`);
* ``NAME.journal``, whole states appended one line each, in the commit log's checksummed line format
  (:func:`rbpipe.storage.commitlog.encode`), every line numbered (``"seq"``).

The state is the snapshot, or the journal's last whole line numbered above it. A process killed mid-append
leaves at most a torn last line, which fails its checksum and is skipped: the state before it wins, as with a
rename that never happened. Once the journal passes ``compact_bytes``, and at :meth:`close`, the snapshot is
rewritten and the journal emptied (a crash in between leaves journal lines numbered at or below the snapshot:
ignored). Like the snapshot alone, nothing is fsynced: a power cut may lose the last moment, never make the
state unreadable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rbpipe.storage.commitlog import decode, encode
from rbpipe.system.fsutil import atomic_write_json

#: the state's number in the snapshot and in each journal line
SEQ = "seq"
JOURNAL_SUFFIX = ".journal"


def load_state(path: str | os.PathLike) -> dict | None:
    """The latest state saved at ``path`` (snapshot plus journal), without its number; None if none was.

    Examples:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "state.json"
        >>> journal = StateJournal(path)
        >>> journal.save({"next": 1}); journal.save({"next": 2})
        >>> load_state(path)  # read by another process while the journal is open
        {'next': 2}
        >>> journal.close(); sorted(p.name for p in path.parent.iterdir())
        ['state.json']
    """
    state = _latest(Path(path))
    if state is not None:
        state.pop(SEQ, None)
    return state


def journal_path_of(path: str | os.PathLike) -> Path:
    """The journal beside the snapshot ``path``: ``<name>.journal``."""
    path = Path(path)
    return path.with_name(path.name + JOURNAL_SUFFIX)


def _latest(path: Path) -> dict | None:
    best = _read_json(path)
    try:
        lines = journal_path_of(path).read_bytes().split(b"\n")
    except FileNotFoundError:
        return best
    for line in lines[:-1]:  # the part after the last newline is empty, or a torn append
        record = decode(line)
        if isinstance(record, dict) and isinstance(record.get(SEQ), int) and record[SEQ] > _seq_of(best):
            best = record
    return best


def _seq_of(state: dict | None) -> int:
    """A state's number; -1 for none, or for a snapshot without one (written by hand, or by an older rbpipe)."""
    seq = (state or {}).get(SEQ)
    return seq if isinstance(seq, int) else -1


def _read_json(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class StateJournal:
    """Saves a JSON object state at ``path`` (a snapshot plus an append-only journal; see the module).

    Args:
        path: the snapshot's path; the journal is beside it, named ``<name>.journal``.
        compact_bytes: journal size past which the next save rewrites the snapshot and empties the journal.

    One process writes a state at a time (the coordinator is its service's only writer); any process may
    :func:`load_state` it at any moment. The key ``"seq"`` of a saved state is the journal's own.

    Examples:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "prompts.json"
        >>> journal = StateJournal(path)
        >>> journal.save({"todo": {"3": 2}})
        >>> StateJournal(path).load()  # e.g. a service resumed after a kill: the journal's last line
        {'todo': {'3': 2}}
    """

    def __init__(self, path: str | os.PathLike, *, compact_bytes: int = 1 << 20) -> None:
        self.path = Path(path)
        self.journal_path = journal_path_of(self.path)
        self.compact_bytes = int(compact_bytes)
        self._seq = max(0, _seq_of(_latest(self.path)))
        self._fd: int | None = None
        self._size = 0

    def load(self) -> dict | None:
        """The latest saved state (see :func:`load_state`)."""
        return load_state(self.path)

    def save(self, state: dict[str, Any]) -> None:
        """Make ``state`` the saved one: one appended line (a snapshot instead, once the journal is large)."""
        self._seq += 1
        line = encode({**state, SEQ: self._seq})
        if self._size + len(line) > self.compact_bytes:
            self._compact(state)
            return
        if self._fd is None:
            self._fd = os.open(self.journal_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._size = os.fstat(self._fd).st_size
            if self._size and os.pread(self._fd, 1, self._size - 1) != b"\n":  # a torn line of a killed writer
                line = b"\n" + line  # ends it, so that it stays one unreadable line instead of spoiling this one
        os.write(self._fd, line)
        self._size += len(line)

    def close(self, state: dict[str, Any] | None = None) -> None:
        """Write the final ``state`` (default: the latest saved) as the snapshot and remove the journal."""
        if state is None:
            state = load_state(self.path)
        if state is not None:
            self._seq += 1
            self._compact(state)
        self._close_fd()
        self.journal_path.unlink(missing_ok=True)

    def _compact(self, state: dict[str, Any]) -> None:
        """The snapshot first (numbered ``self._seq``), then an empty journal: every moment one of them holds
        the latest state."""
        atomic_write_json(self.path, {**state, SEQ: self._seq})
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
        self._size = 0

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
