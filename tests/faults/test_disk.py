"""A full disk and a read-only store: a clear StoreError, nothing torn, everything already stored intact.

Uses a real size-limited tmpfs and a read-only bind mount (needs root; skipped where mounting is refused).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from tensordict import TensorDict

from rbpipe.errors import StoreError
from rbpipe.storage import ArrowStorage, inspect_store


def mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    target = tmp_path / "disk"
    target.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(target)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield target
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


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
def test_read_only_store_reads_but_refuses_writes_in_plain_words(tmp_path):
    src, ro = tmp_path / "src", tmp_path / "ro"
    storage = ArrowStorage(src / "store")
    for i in range(3):
        storage.append_group(group(i))
    storage.close()
    ro.mkdir()
    if not (mount("--bind", str(src), str(ro)) and mount("-o", "remount,bind,ro", str(ro))):
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        pytest.skip("cannot make a read-only bind mount here (needs root)")
    try:
        reader = ArrowStorage(ro / "store", create=False)
        assert len(reader) == 12
        assert inspect_store(ro / "store")["groups_committed"] == 3
        with pytest.raises(StoreError, match="read-only"):
            reader.append_group(group(9))
        assert len(ArrowStorage(ro / "store", create=False)) == 12
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    assert Path(src / "store").is_dir()
