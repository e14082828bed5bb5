"""What a store says when its files are not what the commit log promises: the one line names the real cause."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from tensordict import TensorDict

from rbpipe.errors import StaleReadError, StoreError
from rbpipe.sampling import FreshGroupSampler
from rbpipe.storage import ArrowStorage, ZarrStorage


def group(gid: int) -> TensorDict:
    return TensorDict({"group_id": torch.full((4,), gid), "obs": torch.full((4, 3), float(gid))}, batch_size=[4])


def _data_file(path, cls) -> str:
    if cls is ArrowStorage:
        (seg,) = (path / "segments").glob("*.arrows")
        return str(seg)
    return str(path / "data.zarr" / "obs" / "c" / "0" / "0")


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_a_missing_data_file_of_a_live_group_is_damage_named_not_a_stale_read(tmp_path, cls):
    """Retention and compaction record an eviction or a move before they delete a file; a file of a live group
    that is gone anyway was removed by hand. Telling the sampler to draw again (and the user to raise
    max_size) would hide that: the read names the file."""
    path = tmp_path / "s"
    writer = cls(path)
    for gid in range(2):
        writer.append_group(group(gid))
    writer.close()
    missing = _data_file(path, cls)
    os.unlink(missing)
    reader = cls(path, create=False)
    assert len(reader) == 8
    with pytest.raises(StoreError, match=f"{missing}.*is missing.*live") as err:
        reader.get(torch.arange(0, 4))
    assert not isinstance(err.value, StaleReadError)
    with pytest.raises(StoreError, match="is missing") as err:
        FreshGroupSampler(num_groups=1).sample(cls(path, create=False))
    assert not isinstance(err.value, StaleReadError)


def test_a_commit_log_without_write_permission_is_not_called_a_read_only_file_system(tmp_path, monkeypatch):
    """(The tests run as root, whom permissions do not stop: the refusal is injected where the log is opened.)"""
    path = tmp_path / "s"
    ArrowStorage(path).append_group(group(0))
    log, real_open = str(path / "commits.jsonl"), os.open

    def no_write_permission(file, flags, *args, **kwargs):
        if str(file) == log and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_write_permission)
    store = ArrowStorage(path, create=False)
    assert len(store) == 4  # still readable
    with pytest.raises(StoreError, match="permission denied") as err:
        store.append_group(group(1))
    assert "read-only" not in str(err.value) and "commits.jsonl" in str(err.value)
