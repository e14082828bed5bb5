"""The commit line is the last thing ``append_group`` can fail on. What runs after it (retention's file deletion,
the catalogue) may fail on a real file system (``catalog/`` deleted or unusable, ``.compact.lock`` unopenable);
that is recorded and retried, never raised as a failed write: a caller retrying a "failed" write without a
``commit_id`` would store the group twice. And a group refused by its checks commits nothing, not even the
schema it would have fixed."""

from __future__ import annotations

import shutil
import warnings

import pyarrow.parquet as pq
import pytest
import torch
from tensordict import TensorDict

from rbpipe.errors import SchemaError, StoreError
from rbpipe.storage import ArrowStorage, ZarrStorage, read_catalog
from rbpipe.storage.catalog import repair_catalog
from rbpipe.storage.ledger import scan
from rbpipe.storage.retention import data_bytes


def group(gid: int, width: int = 4) -> TensorDict:
    return TensorDict({"group_id": torch.full((4,), gid), "obs": torch.full((4, width), float(gid))}, batch_size=[4])


def append_retrying(store, td, tries: int = 3) -> None:
    """What a caller does with a write that raised: write it again (no commit id)."""
    for _ in range(tries):
        try:
            store.append_group(td)
            return
        except StoreError:
            continue
    raise AssertionError("the write kept failing")


def committed_gids(path) -> list[int]:
    return [rec["gid"] for rec in scan(path).groups.values()]


def catalogue_seqs(path) -> list[int]:
    return sorted(s for f in (path / "catalog").glob("*.parquet") for s in pq.read_table(f).column("seq").to_pylist())


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_a_deleted_catalogue_directory_fails_no_write_and_is_recreated(tmp_path, cls):
    path = tmp_path / "s"
    store = cls(path, catalog_every=1)
    store.append_group(group(0))
    shutil.rmtree(path / "catalog")
    for gid in (1, 2):
        append_retrying(store, group(gid))
    store.close()
    assert committed_gids(path) == [0, 1, 2]  # each once: no write raised after its commit
    assert repair_catalog(path) == 1  # group 0's row went with the directory; the log has it
    assert catalogue_seqs(path) == sorted(scan(path).groups)


def test_repair_catalog_recreates_a_missing_catalogue_directory(tmp_path):
    path = tmp_path / "s"
    store = ArrowStorage(path)
    for gid in range(3):
        store.append_group(group(gid))
    store.close()
    shutil.rmtree(path / "catalog")
    assert repair_catalog(path) == 3
    assert read_catalog(path).column("group_id").to_pylist() == [0, 1, 2]
    assert catalogue_seqs(path) == sorted(scan(path).groups)


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_an_unwritable_catalogue_is_recorded_and_flushed_once_it_works_again(tmp_path, cls):
    """``catalog`` is a file here: no catalogue file can be created in it (a real OSError, as on a directory
    that is not writable or a full disk). Writes go on, ``close()`` seals and warns instead of raising, and
    the rows waiting are written once the directory works again."""
    path = tmp_path / "s"
    store = cls(path, catalog_every=1, catalog_interval_s=0.0)
    store.append_group(group(0))
    shutil.rmtree(path / "catalog")
    (path / "catalog").write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="catalogue of the store .*retried"):
        for gid in range(1, 4):
            append_retrying(store, group(gid))
    assert committed_gids(path) == [0, 1, 2, 3]
    assert "catalogue" in store.maintenance_errors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        store.close()  # seals (below) although the catalogue still fails
    if cls is ArrowStorage:
        assert not list((path / "segments").glob("*.inprogress"))
    (path / "catalog").unlink()
    store.append_group(group(4))  # the next commit retries: the rows of 1..4 are written
    assert "catalogue" not in store.maintenance_errors
    assert catalogue_seqs(path) == sorted(scan(path).groups)[1:]
    store.close()


def test_an_unopenable_compact_lock_fails_no_write_and_files_are_freed_once_it_opens(tmp_path):
    """Retention deletes emptied segment files under ``.compact.lock``; a lock file that cannot be opened (a
    directory here) must not turn committed writes into errors; the deletion is retried."""
    path = tmp_path / "s"
    big = 200_000  # ~3 MB a group: each commit seals its segment, so evicted groups free whole files
    store = ArrowStorage(path, max_size=8)
    (path / ".compact.lock").mkdir()
    with pytest.warns(RuntimeWarning, match="retention"):
        for gid in range(6):
            append_retrying(store, group(gid, big))
    assert committed_gids(path) == list(range(6))
    assert [int(x) for x in store.get(slice(None))["group_id"][::4]] == [4, 5]
    held = data_bytes(path)
    (path / ".compact.lock").rmdir()
    store.append_group(group(6, big))
    assert "retention" not in store.maintenance_errors
    assert data_bytes(path) < held / 2, (data_bytes(path), held)  # the evicted groups' files are gone now
    store.close()


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_a_refused_first_group_commits_no_schema(tmp_path, cls):
    """A first group with a leaf of another type than tensor or str is refused; the store stays without a
    schema, so the next (valid) group fixes it (FORMAT.md: the first *stored* group fixes the schema)."""
    path = tmp_path / "s"
    store = cls(path)
    bad = group(0)
    bad.set_non_tensor("meta", {"not": "a string"})
    with pytest.raises(SchemaError, match="meta"):
        store.append_group(bad)
    assert scan(path).schema is None
    store.append_group(group(1))
    assert committed_gids(path) == [1]
    assert [c["column"] for c in scan(path).schema] == ["group_id", "obs"]
