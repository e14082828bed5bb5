"""A full disk and a read-only store: a clear StoreError, nothing torn, everything already stored intact.

No mounting (CI runs unprivileged): :class:`SimulatedDisk` makes a directory behave like a small disk
(``ENOSPC`` once the files under it would exceed its size: short writes, then the error, as the kernel does)
or like a read-only file system (``EROFS`` for any write, create, rename or delete under it). It patches the
calls that write files, for paths under that directory only: ``os.open`` with write flags, ``os.write``,
``os.pwrite``, ``os.truncate``/``ftruncate``, renames, links, deletes, ``mkdir``, ``open``/``io.open`` in a
write mode, and ``pyarrow.OSFile`` (Arrow segments are written by Arrow's C++ file, which no ``os`` patch
reaches: a segment is opened as a Python file that Arrow writes through instead).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from tensordict import TensorDict

from rbpipe.errors import StoreError
from rbpipe.storage import ArrowStorage, inspect_store

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class SimulatedDisk:
    """``root`` as a disk of ``size`` bytes (the sizes of the files under it), or read-only (``size=None``)."""

    def __init__(self, monkeypatch, root: Path, size: int | None) -> None:
        self.root, self.size = str(Path(root).absolute()), size
        real = {name: getattr(os, name) for name in ("open", "write", "pwrite", "truncate", "ftruncate", "rename",
                                                      "replace", "link", "unlink", "mkdir", "rmdir")}
        real_open, disk = builtins.open, self

        def under(path) -> bool:
            if isinstance(path, int):
                try:
                    path = os.readlink(f"/proc/self/fd/{path}")
                except OSError:
                    return False
            return os.path.abspath(os.fsdecode(path)).startswith(self.root + os.sep) or \
                os.path.abspath(os.fsdecode(path)) == self.root

        def refuse(path) -> None:
            if self.size is None and under(path):
                raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path) if not isinstance(path, int)
                              else None)

        def room() -> int:
            used = 0
            for base, _, files in os.walk(self.root):
                for name in files:
                    try:
                        used += os.stat(os.path.join(base, name)).st_size
                    except FileNotFoundError:
                        pass
            return self.size - used

        def fitting(data) -> memoryview:
            """What of ``data`` fits (ENOSPC when nothing does): a full disk takes a short write first."""
            data = memoryview(data).cast("B")
            left = room()
            if left <= 0 and len(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            return data[:left]

        def os_open(path, flags, *args, **kwargs):
            if flags & _WRITE_FLAGS:
                refuse(path)
            return real["open"](path, flags, *args, **kwargs)

        def os_write(fd, data):
            if not under(fd):
                return real["write"](fd, data)
            refuse(fd)
            return real["write"](fd, fitting(data) if self.size is not None else data)

        def os_pwrite(fd, data, offset):
            if not under(fd):
                return real["pwrite"](fd, data, offset)
            refuse(fd)
            return real["pwrite"](fd, fitting(data), offset)

        def guard(name: str, args: int = 1):
            def call(*a, **kw):
                for path in a[:args]:
                    refuse(path)
                return real[name](*a, **kw)
            return call

        def mkdir(path, *a, **kw):
            if self.size is None and under(path) and os.path.exists(path):
                raise FileExistsError(errno.EEXIST, "File exists", os.fsdecode(path))
            refuse(path)
            return real["mkdir"](path, *a, **kw)

        def py_open(file, mode="r", *a, **kw):
            if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and under(file):
                refuse(file)
                if self.size is not None and "b" in mode:
                    return _QuotaFile(file, mode.replace("b", ""), disk)
            return real_open(file, mode, *a, **kw)

        def arrow_file(path, mode="r", *a, **kw):
            if set(mode) & set("wa") and under(path):
                refuse(path)
                if self.size is not None:
                    return _QuotaFile(path, mode.replace("b", ""), disk)
            return real_arrow_file(path, mode, *a, **kw)

        real_arrow_file = pa.OSFile
        self.fitting = fitting
        for name, fn in dict(open=os_open, write=os_write, pwrite=os_pwrite, truncate=guard("truncate"),
                             ftruncate=guard("ftruncate"), rename=guard("rename", 2), replace=guard("replace", 2),
                             link=guard("link", 2), unlink=guard("unlink"), rmdir=guard("rmdir"),
                             mkdir=mkdir).items():
            monkeypatch.setattr(os, name, fn)
        monkeypatch.setattr(builtins, "open", py_open)
        monkeypatch.setattr(io, "open", py_open)
        monkeypatch.setattr(pa, "OSFile", arrow_file)


class _QuotaFile(io.FileIO):
    """A file on the simulated disk: writes what fits, then fails with ENOSPC (as a C++ writer that retries
    short writes does)."""

    def __init__(self, path, mode: str, disk: SimulatedDisk) -> None:
        super().__init__(path, mode)
        self._disk = disk

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        part = self._disk.fitting(data)
        super().write(part)
        if len(part) < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    target = tmp_path / "disk"
    target.mkdir()
    SimulatedDisk(monkeypatch, target, size=256 * 1024)
    return target


def group(i: int) -> TensorDict:
    return TensorDict({"group_id": torch.full((4,), i), "x": torch.randn(4, 2000)}, [4])


@pytest.mark.timeout(60)
def test_full_disk_is_a_clear_error_and_committed_groups_survive(small_disk):
    storage = ArrowStorage(small_disk / "store")
    written = 0
    with pytest.raises(StoreError, match="disk is full") as info:
        for i in range(100):
            storage.append_group(group(i))
            written += 1
    assert "Traceback" not in str(info.value) and "intact" in str(info.value)
    assert written > 0
    reopened = ArrowStorage(small_disk / "store", create=False)
    assert len(reopened) == 4 * written  # only whole, committed groups
    ids = reopened.get(torch.arange(len(reopened))).get("group_id").reshape(-1, 4)
    assert (ids == ids[:, :1]).all() and ids[:, 0].tolist() == list(range(written))
    assert inspect_store(small_disk / "store", limit=None)["groups_committed"] == written


@pytest.mark.timeout(60)
def test_after_a_full_disk_is_freed_writing_resumes_in_a_new_segment(small_disk):
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * 96 * 1024)
    storage = ArrowStorage(small_disk / "store")
    written = 0
    with pytest.raises(StoreError, match="disk is full"):
        for i in range(100):
            storage.append_group(group(i))
            written += 1
    ballast.unlink()  # space again: the same storage object goes on writing
    storage.append_group(group(1000))
    storage.close()
    segments = sorted(p.name for p in (small_disk / "store" / "segments").iterdir())
    assert len(segments) == 2 and all(name.endswith(".arrows") for name in segments)  # both sealed
    reopened = ArrowStorage(small_disk / "store", create=False)
    ids = reopened.get(torch.arange(len(reopened))).get("group_id").reshape(-1, 4)
    assert ids[:, 0].tolist() == list(range(written)) + [1000]  # the cut-off batch never shows up
    assert inspect_store(small_disk / "store", limit=None)["groups_committed"] == written + 1
    for name in segments:  # each sealed segment is a complete Arrow IPC stream for any reader
        with pa.ipc.open_stream(small_disk / "store" / "segments" / name) as reader:
            assert sum(b.num_rows for b in reader) > 0


@pytest.mark.timeout(60)
def test_read_only_store_reads_but_refuses_writes_in_plain_words(tmp_path, monkeypatch):
    src = tmp_path / "src"
    storage = ArrowStorage(src / "store")
    for i in range(3):
        storage.append_group(group(i))
    storage.close()
    before = sorted((p.relative_to(src), p.stat().st_size) for p in src.rglob("*") if p.is_file())
    with monkeypatch.context() as patch:
        SimulatedDisk(patch, src, size=None)
        reader = ArrowStorage(src / "store", create=False)
        assert len(reader) == 12
        assert inspect_store(src / "store")["groups_committed"] == 3
        with pytest.raises(StoreError, match="read-only"):
            reader.append_group(group(9))
        assert len(ArrowStorage(src / "store", create=False)) == 12
        reader.close()
    assert sorted((p.relative_to(src), p.stat().st_size) for p in src.rglob("*") if p.is_file()) == before


def test_the_simulated_disk_fails_like_a_full_and_a_read_only_one(tmp_path, monkeypatch):
    """The injection itself: short write, then ENOSPC; EROFS for any change; other paths untouched."""
    with monkeypatch.context() as patch:
        SimulatedDisk(patch, tmp_path / "small", size=10)
        (tmp_path / "small").mkdir()
        fd = os.open(tmp_path / "small" / "f", os.O_WRONLY | os.O_CREAT)
        assert os.write(fd, b"x" * 16) == 10  # what fits
        with pytest.raises(OSError) as info:
            os.write(fd, b"y")
        assert info.value.errno == errno.ENOSPC
        os.close(fd)
        with pytest.raises(OSError) as info:
            with pa.OSFile(str(tmp_path / "small" / "g"), "wb") as f:
                f.write(b"z")
        assert info.value.errno == errno.ENOSPC
        (tmp_path / "elsewhere").write_bytes(b"w" * 100)  # outside the disk: no limit
    with monkeypatch.context() as patch:
        SimulatedDisk(patch, tmp_path / "small", size=None)
        for act in (lambda: (tmp_path / "small" / "h").write_bytes(b""), lambda: (tmp_path / "small" / "f").unlink(),
                    lambda: os.rename(tmp_path / "small" / "f", tmp_path / "small" / "i"),
                    lambda: os.open(tmp_path / "small" / "f", os.O_RDWR)):
            with pytest.raises(OSError) as info:
                act()
            assert info.value.errno == errno.EROFS
        assert (tmp_path / "small" / "f").read_bytes() == b"x" * 10  # reads work
