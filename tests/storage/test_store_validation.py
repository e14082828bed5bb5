"""Stores refuse what they cannot serve whole (issue 15, items 4-7): slice writes, truncated Zarr chunks, a
missing commit log, schemas that can never be stored, unreadable side files and schema lines."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import ReplayBuffer

from rbpipe.errors import SchemaError, StoreError
from rbpipe.storage import ArrowStorage, ZarrStorage, collate_identity, open_storage, read_catalog
from rbpipe.storage.catalog import repair_catalog
from rbpipe.storage.columns import ColumnSet
from rbpipe.storage.format import COMMIT_LOG

BACKENDS = [ArrowStorage, ZarrStorage]


def _group(n: int = 4, base: float = 0.0) -> TensorDict:
    return TensorDict(a=torch.arange(n, dtype=torch.float32) + base, b=torch.ones(n, 3) * base,
                      batch_size=[n])


def _filled(cls, path, groups: int = 3, n: int = 4, **kw):
    store = cls(path, **kw)
    for i in range(groups):
        store.append_group(_group(n, base=i + 1))
    return store


# -- item 4: slice assignment ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", BACKENDS)
def test_slice_assignment_is_refused(tmp_path, cls):
    store = _filled(cls, tmp_path / "s", groups=10, n=1)
    rb = ReplayBuffer(storage=store, collate_fn=collate_identity)
    for index in (slice(3, 4), slice(None, 1), slice(10, None, 2)):
        with pytest.raises(StoreError, match="append-only"):
            rb[index] = _group(1)
    with pytest.raises(StoreError, match="append-only"):
        store.set(slice(3, 4), _group(1))
    assert len(store) == 10


@pytest.mark.parametrize("cls", BACKENDS)
def test_writes_at_the_end_still_append(tmp_path, cls):
    store = _filled(cls, tmp_path / "s", groups=2, n=2)
    store.set(torch.arange(4, 6), _group(2))
    store.set(slice(6, 8), _group(2))
    assert len(store) == 8
    with pytest.raises(StoreError, match="append-only"):  # starts at the end, then wraps to row 0
        store.set(torch.tensor([8, 0]), _group(2))
    assert len(store) == 8


# -- item 5: torn Zarr chunks, missing commit log ----------------------------------------------------------
def _chunk_file(store_path, name: str = "a"):
    root = store_path / "data.zarr" / name / "c"
    files = sorted(p for p in root.rglob("*") if p.is_file())
    assert files, f"no chunk files under {root}"
    return files[0]


@pytest.mark.parametrize("size", [20, 0])
def test_truncated_zarr_chunk_raises(tmp_path, size):
    _filled(ZarrStorage, tmp_path / "s").close()
    chunk = _chunk_file(tmp_path / "s")
    os.truncate(chunk, size)
    store = ZarrStorage(tmp_path / "s", create=False)
    with pytest.raises(StoreError, match=str(chunk.relative_to(tmp_path / "s"))):
        store.get(slice(0, 12))


@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_truncated_arrow_segment_raises(tmp_path, cut):
    """Committed bytes cut off (or a batch cut mid-body) raise a StoreError naming the segment, never a raw
    Arrow error or other rows."""
    _filled(ArrowStorage, tmp_path / "s").close()
    (segment,) = (tmp_path / "s" / "segments").glob("*.arrows")
    os.truncate(segment, int(segment.stat().st_size * cut))
    store = ArrowStorage(tmp_path / "s", create=False)
    with pytest.raises(StoreError, match=f"segment .*{segment.name}.* is damaged"):
        store.get(slice(0, 12))


def test_zero_byte_chunk_without_committed_rows_is_padding(tmp_path):
    """A writer killed between creating a chunk file and sizing it leaves 0 bytes and no commit into it."""
    _filled(ZarrStorage, tmp_path / "s").close()
    chunk = _chunk_file(tmp_path / "s")
    (chunk.parent / "7").write_bytes(b"")
    store = ZarrStorage(tmp_path / "s", create=False)
    assert store.get(slice(0, 12))["a"].tolist() == [float(i % 4 + 1 + i // 4) for i in range(12)]
    store.append_group(_group(4, base=9))
    assert store.get(slice(12, 16))["a"].tolist() == [9.0, 10.0, 11.0, 12.0]


@pytest.mark.parametrize("cls", BACKENDS)
def test_missing_commit_log_refuses_to_open(tmp_path, cls):
    _filled(cls, tmp_path / "s").close()
    (tmp_path / "s" / COMMIT_LOG).unlink()
    for opener in (lambda: cls(tmp_path / "s"), lambda: cls(tmp_path / "s", create=False),
                   lambda: open_storage(tmp_path / "s"), lambda: read_catalog(tmp_path / "s")):
        with pytest.raises(StoreError, match=COMMIT_LOG):
            opener()
    assert not (tmp_path / "s" / COMMIT_LOG).exists()  # nothing was created in its place


@pytest.mark.parametrize("cls", BACKENDS)
def test_new_store_has_a_commit_log(tmp_path, cls):
    cls(tmp_path / "s")
    assert (tmp_path / "s" / COMMIT_LOG).is_file()
    (tmp_path / "s" / COMMIT_LOG).unlink()  # a creator killed before its log existed: no data, no loss
    store = cls(tmp_path / "s")
    store.append_group(_group())
    assert len(cls(tmp_path / "s", create=False)) == 4


# -- item 6: schemas that can never be stored ----------------------------------------------------------------
UNSTORABLE = {
    "zero-size dim": (TensorDict(a=torch.zeros(2, 0), b=torch.ones(2), batch_size=[2]), ()),
    "ragged scalar": (TensorDict(s=torch.zeros(2), batch_size=[2]), ("s",)),
    "dotted twin": (TensorDict({"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}}, batch_size=[2]), ()),
    "arrow shape suffix": (TensorDict({"x.__shape": torch.zeros(2), "x": torch.ones(2, 3)}, batch_size=[2]),
                           ("x",)),
    "zarr shape suffix": (TensorDict({"x.shape": torch.zeros(2), "x": torch.ones(2, 3)}, batch_size=[2]),
                          ("x",)),
    "case twin": (TensorDict({"A": torch.zeros(2), "a": torch.ones(2)}, batch_size=[2]), ()),
    "slash": (TensorDict({"a/b": torch.zeros(2)}, batch_size=[2]), ()),
    "empty part": (TensorDict({"": torch.zeros(2)}, batch_size=[2]), ()),
    "dots only": (TensorDict({"..": torch.zeros(2)}, batch_size=[2]), ()),
    "zarr reserved prefix": (TensorDict({"__x": torch.zeros(2)}, batch_size=[2]), ()),
    "no rows": (TensorDict(a=torch.zeros(0, 2), batch_size=[0]), ()),
}


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize("case", sorted(UNSTORABLE))
def test_unstorable_schema_rejected_before_commit(tmp_path, cls, case):
    td, ragged = UNSTORABLE[case]
    store = cls(tmp_path / "s", ragged_keys=ragged)
    with pytest.raises(SchemaError) as err:
        store.append_group(td)
    assert "\n" not in str(err.value)
    assert (tmp_path / "s" / COMMIT_LOG).read_bytes() == b""  # no schema line was committed
    store.append_group(_group())  # the store still takes a storable group
    assert len(cls(tmp_path / "s", create=False)) == 4


KEY_PARTS = st.sampled_from(["a", "A", "b", "a.b", "x", "x.__shape", "x.values", "x.shape", "x.start", "v"])


def _td_of(keys: list[tuple[str, ...]]) -> TensorDict | None:
    """A TensorDict with a ``[2, 3]`` leaf at each key, or None when the keys are no tree (a key is both a leaf
    and a parent, or repeats)."""
    tree: dict = {}
    for key in keys:
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return None
        if key[-1] in node:
            return None
        node[key[-1]] = torch.ones(2, 3)
    return TensorDict(tree, batch_size=[2])


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.lists(KEY_PARTS, min_size=1, max_size=2).map(tuple), min_size=1, max_size=5,
                     unique=True),
       ragged=st.sets(st.integers(0, 4)))
def test_accepted_schemas_have_distinct_physical_names(keys, ragged):
    """Whatever ``infer`` accepts is storable on both backends: every Arrow field and Zarr array name is
    distinct even ignoring case; whatever it refuses is refused with a SchemaError."""
    td = _td_of(keys)
    if td is None:
        return
    declared = [k for i, k in enumerate(keys) if i in ragged]
    try:
        schema = ColumnSet.infer(td, declared)
    except SchemaError:
        return
    names = []
    for c in schema.columns:
        names += [c.name] + ([c.name + ".__shape", c.name + ".values", c.name + ".start", c.name + ".shape"]
                             if c.ragged else [])
    assert len({n.lower() for n in names}) == len(names)


@pytest.mark.parametrize("cls", BACKENDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.lists(st.lists(KEY_PARTS, min_size=1, max_size=2).map(tuple), min_size=1, max_size=4,
                     unique=True))
def test_accepted_schema_takes_a_group(tmp_path_factory, cls, keys):
    td = _td_of(keys)
    if td is None:
        return
    store = cls(tmp_path_factory.mktemp("s") / "s", ragged_keys=keys[:1])
    try:
        store.append_group(td)
    except SchemaError:
        assert store.schema is None
        return
    assert len(store.get(slice(0, 2))) == 2


# -- item 7: unreadable side files, unreadable schema line -------------------------------------------------
@pytest.mark.parametrize("cls", BACKENDS)
def test_repair_catalog_on_corrupt_file_raises_store_error(tmp_path, cls):
    _filled(cls, tmp_path / "s").close()
    bad = next((tmp_path / "s" / "catalog").glob("*.parquet"))
    bad.write_bytes(b"not parquet")
    with pytest.raises(StoreError, match=bad.name):
        repair_catalog(tmp_path / "s")
    assert repair_catalog(tmp_path / "s", drop_unreadable=True) == 3
    assert bad.with_name(bad.name + ".unreadable").read_bytes() == b"not parquet"
    files = sorted((tmp_path / "s" / "catalog").glob("*.parquet"))
    assert sorted(pq.read_table(files).column("seq").to_pylist()) == [1, 2, 3]
    assert repair_catalog(tmp_path / "s") == 0


def test_unreadable_zarr_alloc_raises_store_error(tmp_path):
    store = _filled(ZarrStorage, tmp_path / "s")
    store.close()
    (tmp_path / "s" / "zarr_alloc.json").write_text('{"rows": 12')
    store = ZarrStorage(tmp_path / "s", create=False)
    with pytest.raises(StoreError, match="zarr_alloc.json"):
        store.append_group(_group())
    assert len(store) == 12


def test_missing_zarr_alloc_never_reuses_committed_rows(tmp_path):
    _filled(ZarrStorage, tmp_path / "s").close()
    (tmp_path / "s" / "zarr_alloc.json").unlink()
    store = ZarrStorage(tmp_path / "s", create=False)
    store.append_group(_group(4, base=7))
    fresh = ZarrStorage(tmp_path / "s", create=False)
    assert fresh.get(slice(0, 4))["a"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert fresh.get(slice(12, 16))["a"].tolist() == [7.0, 8.0, 9.0, 10.0]


@pytest.mark.parametrize("cls", BACKENDS)
def test_unreadable_schema_line_raises_store_error(tmp_path, cls):
    _filled(cls, tmp_path / "s").close()
    log = tmp_path / "s" / COMMIT_LOG
    lines = log.read_bytes().split(b"\n")
    assert json.loads(lines[0][9:])["t"] == "schema"
    lines[0] = lines[0][:20] + b"X" + lines[0][21:]  # a damaged byte: the checksum fails
    log.write_bytes(b"\n".join(lines))
    with pytest.raises(StoreError, match="schema"):
        cls(tmp_path / "s", create=False)


# -- item 8: the commit log is strict JSON -------------------------------------------------------------------
def _strict(body: bytes):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(body, parse_constant=refuse)


@pytest.mark.parametrize("cls", BACKENDS)
def test_catalogue_values_are_strict_json(tmp_path, cls):
    store = cls(tmp_path / "s")
    reward = torch.tensor([[0.5], [float("nan")], [float("inf")], [-float("inf")]])
    store.append_group(TensorDict({"next": {"reward": reward}, "a": torch.ones(4)}, batch_size=[4]))
    store.close()
    lines = (tmp_path / "s" / COMMIT_LOG).read_bytes().splitlines()
    records = [_strict(line[9:]) for line in lines]
    assert records[1]["cat"]["returns"] == [0.5, "NaN", "Infinity", "-Infinity"]
    returns = read_catalog(tmp_path / "s").column("returns").to_pylist()[0]
    assert returns[0] == 0.5 and returns[1] != returns[1] and returns[2:] == [float("inf"), -float("inf")]


def test_old_nan_tokens_still_read(tmp_path):
    """Stores written before the strict encoding hold bare NaN/Infinity tokens in ``cat``."""
    from rbpipe.storage.commitlog import encode
    store = ArrowStorage(tmp_path / "s")
    store.append_group(TensorDict({"next": {"reward": torch.ones(2, 1)}}, batch_size=[2]))
    store.close()
    log = tmp_path / "s" / COMMIT_LOG
    lines = log.read_bytes().splitlines()
    rec = json.loads(lines[1][9:])
    rec["cat"]["returns"] = [float("nan"), float("inf")]
    body = json.dumps(rec, separators=(",", ":"), sort_keys=True).encode()
    assert b"NaN" in body
    line = encode(json.loads(body))
    log.write_bytes(lines[0] + b"\n" + line)
    returns = read_catalog(tmp_path / "s").column("returns").to_pylist()[0]
    assert returns[0] != returns[0] and returns[1] == float("inf")
    assert len(ArrowStorage(tmp_path / "s", create=False)) == 2


@pytest.mark.parametrize("cls", BACKENDS)
def test_catalogue_sums_and_lengths_are_of_the_values(tmp_path, cls):
    """bfloat16 is stored as raw bits and complex with a trailing 2: the catalogue reads through both."""
    store = cls(tmp_path / "s", catalog_columns={"returns": (("next", "reward"), "value"),
                                                 "lengths": ("z", "length"), "halves": ("h", "value")})
    reward = torch.tensor([[1.5, 2.0], [-0.25, 0.0]], dtype=torch.bfloat16)
    store.append_group(TensorDict({"next": {"reward": reward}, "z": torch.ones(2, dtype=torch.complex64),
                                   "h": torch.full((2, 4), 30000.0, dtype=torch.float16)}, batch_size=[2]))
    store.close()
    row = read_catalog(tmp_path / "s").to_pylist()[0]
    assert row["returns"] == [3.5, -0.25]
    assert row["lengths"] == [1.0, 1.0]
    assert row["halves"] == [120000.0, 120000.0]


@pytest.mark.parametrize("cls", BACKENDS)
def test_complex_and_ragged_columns_read_as_format_md_says(tmp_path, cls):
    """A reader written from docs/FORMAT.md alone: complex elements are 2 scalars, shapes count elements,
    Arrow offsets count scalars, Zarr ``start`` counts elements (rows of a ``[., 2]`` values array)."""
    import numpy as np
    import pyarrow as pa
    import zarr
    from tensordict import lazy_stack
    rows = [TensorDict(z=torch.complex(torch.randn(2), torch.randn(2)),
                       r=torch.complex(torch.randn(k, 3), torch.randn(k, 3))) for k in (1, 4, 0)]
    store = cls(tmp_path / "s", ragged_keys=["r"])
    store.append_group(lazy_stack(rows))
    store.close()
    records = [json.loads(line[9:]) for line in (tmp_path / "s" / COMMIT_LOG).read_bytes().splitlines()]
    cols = {c["column"]: c for c in records[0]["schema"]}
    assert cols["z"]["dtype"] == "complex64" and cols["z"]["shape"] == [2]
    assert cols["r"]["shape"] is None and cols["r"]["ndim"] == 2
    loc = records[1]["loc"]
    if cls is ArrowStorage:
        buf = pa.py_buffer((tmp_path / "s" / "segments" / (loc["seg"] + ".arrows")).read_bytes())
        schema = pa.ipc.read_schema(pa.BufferReader(buf))
        assert [f.name for f in schema] == ["r", "r.__shape", "z"]
        assert schema.field("z").type == pa.list_(pa.float32(), 4)
        batch = pa.ipc.read_record_batch(pa.ipc.read_message(buf.slice(loc["off"], loc["len"])), schema)
        offsets = batch.column("r").offsets.to_pylist()
        flat = np.asarray(batch.column("r").values)
        shapes = batch.column("r.__shape").to_pylist()
        z = np.asarray(batch.column("z").values).reshape(3, 2, 2)
        got = [flat[a:b].reshape(*s, 2) for a, b, s in zip(offsets, offsets[1:], shapes, strict=False)]
        assert offsets == [0, 6, 30, 30]
    else:
        g = zarr.open_group(str(tmp_path / "s" / "data.zarr"), mode="r")
        row = loc["row"]
        starts, shapes = g["r.start"][row:row + 3], g["r.shape"][row:row + 3].tolist()
        assert loc["vals"]["r"] == starts[0] and (starts - starts[0]).tolist() == [0, 3, 15]
        got = [g["r.values"][s:s + int(np.prod(sh))].reshape(*sh, 2) for s, sh in zip(starts, shapes, strict=True)]
        z = g["z"][row:row + 3]
    for i, td in enumerate(rows):
        assert np.array_equal(torch.view_as_complex(torch.from_numpy(np.ascontiguousarray(got[i]))), td["r"])
        assert np.array_equal(torch.view_as_complex(torch.from_numpy(np.ascontiguousarray(z[i]))), td["z"])
