"""Owner locks: whether the owner of a file, a directory or a store still lives is told by an ``flock`` it holds on
a lock file for its life, never by a PID.

The kernel drops an ``flock`` when its holder exits, however it exits (SIGKILL included), and a process in another
PID namespace or container sharing the filesystem holds it just the same, so there is never a stale owner to
judge nor a takeover race between those who found one stale. Three users, one recipe: the staging area's
subdirectories (``.<name>.owner`` beside each), the directories of processes' Unix sockets (``.owner`` inside),
and a store's writer lock (``STORE/.lock``).

A lock file that is unlinked while someone waits for it locks nothing that the next process opens: whoever takes a
lock checks that its file is still linked (:func:`create_held`, :func:`take_if_free`) or still the one at its path
(:func:`still_at`).

Examples:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), ".owner")
    >>> fd = create_held(path)
    >>> take_if_free(path) is None  # its owner (this process, through another descriptor) lives
    True
    >>> os.close(fd)
    >>> fd = take_if_free(path); fd >= 0  # its owner is gone: whoever sweeps holds it now
    True
    >>> os.unlink(path); os.close(fd); take_if_free(path) == NO_LOCK_FILE
    True
"""

from __future__ import annotations

import fcntl
import os

#: :func:`take_if_free`'s answer when there is no lock file at all.
NO_LOCK_FILE = -1


def try_flock(fd: int) -> bool:
    """Take ``fd``'s exclusive ``flock`` without waiting: False while another open file description holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _held_and_linked(fd: int) -> int | None:
    """``fd`` once its lock is held and its file still linked; else ``fd`` is closed and None returned."""
    try:
        if try_flock(fd) and os.fstat(fd).st_nlink > 0:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def create_held(path: str | os.PathLike[str], mode: int = 0o600) -> int | None:
    """A new lock file at ``path``, held by this process for as long as the returned descriptor stays open. None
    when ``path`` exists, its directory is gone, or a sweep unlinked it between creation and lock: take another
    name."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except (FileExistsError, FileNotFoundError):
        return None
    return _held_and_linked(fd)


def take_if_free(path: str | os.PathLike[str]) -> int | None:
    """A descriptor holding ``path``'s lock when nobody else holds it (its owner is gone: close it when done);
    None while its owner lives (or another sweep is at it); :data:`NO_LOCK_FILE` when there is no lock file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return NO_LOCK_FILE
    return _held_and_linked(fd)


def still_at(path: str | os.PathLike[str], fd: int) -> bool:
    """Whether ``fd`` is the file now at ``path``: a holder that lets go may delete its lock file, and a lock
    taken on the deleted file would lock nothing that the next process opens."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
