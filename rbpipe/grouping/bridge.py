"""Let stdlib ``multiprocessing`` shared objects travel into ``multiprocess`` spawn children.

torchrl's shared pieces are stdlib objects: ``ReplayBuffer._write_lock`` (a ``multiprocessing.Lock``), the
length and cursor ``mp.Value`` of tensor storages and writers, and the stdlib manager proxies of the stock
shared ``MCAdvantage``. They only pickle while *stdlib's* process spawner is active (``get_spawning_popen``),
and the manager/resource-sharer connections authenticate with the stdlib ``current_process().authkey``.
Under ``multiprocess`` spawn neither holds, so locks refuse to pickle, lengths silently stop being shared,
and proxies fail authentication.

:class:`StdlibBridge` fixes both at the pickling step: while ``multiprocess`` is spawning a child, it
pickles the wrapped object with stdlib's ``ForkingPickler`` with stdlib's spawning popen temporarily set to
``multiprocess``'s (file descriptors of shared values are then passed to the child by ``multiprocess``), and
on unpickling it installs the parent's stdlib authkey in the child *before* the wrapped object (and its
proxies) is rebuilt.
"""

from __future__ import annotations

import io
import multiprocessing.context as std_context
import multiprocessing.process as std_process
import multiprocessing.reduction as std_reduction
import pickle
from typing import Any, cast

import multiprocess.context as mp_context


def spawning() -> bool:
    """True while ``multiprocess`` is pickling the arguments of a child it spawns."""
    return mp_context.get_spawning_popen() is not None


def _rebuild(authkey: bytes, payload: bytes) -> Any:
    # AuthenticationString exists at runtime but is not in typeshed's multiprocessing.process
    std_process.current_process().authkey = std_process.AuthenticationString(authkey)  # type: ignore[attr-defined]
    return pickle.loads(payload)


class _DedupPopen:
    """``multiprocess``'s popen as stdlib sees it; passes each fd once (several Values share one arena fd)."""

    def __init__(self, popen) -> None:
        self._popen = popen

    def duplicate_for_child(self, fd: int) -> int:
        if fd in getattr(self._popen, "_fds", ()):
            return fd
        return self._popen.duplicate_for_child(fd)

    def __getattr__(self, name: str):
        return getattr(self._popen, name)


def bridged_reduce(obj: Any) -> tuple:
    """A ``__reduce__`` value that rebuilds ``obj`` in a ``multiprocess`` spawn child with stdlib sharing."""
    popen = mp_context.get_spawning_popen()
    set_here = popen is not None and std_context.get_spawning_popen() is None
    if set_here:
        std_context.set_spawning_popen(cast(Any, _DedupPopen(popen)))  # duck-typed: typeshed names concrete Popens
    try:
        buf = io.BytesIO()
        std_reduction.ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        if set_here:
            std_context.set_spawning_popen(None)
    return _rebuild, (bytes(std_process.current_process().authkey), buf.getvalue())


class StdlibBridge:
    """Wrap any object so it crosses into a ``multiprocess`` spawn child with its stdlib shared state."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self):
        return bridged_reduce(self.obj)
