"""Round trips, schema errors, store errors, retention, pickling, catalogue."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from helpers_storage import llm_group
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack

from rbpipe.errors import SchemaError, StoreError
from rbpipe.storage import ArrowStorage, ZarrStorage, export_zarr, inspect_store, open_storage, read_catalog
from rbpipe.storage.format import META_FILE
from rbpipe.trajectory import RAGGED_KEYS

BACKENDS = [ArrowStorage, ZarrStorage]
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def _rand(shape, dtype, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype) if not dtype.is_complex else torch.complex(
            torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("cls", BACKENDS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype_idx=st.lists(st.integers(0, len(DTYPES) - 1), min_size=1, max_size=3),
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3), seed=st.integers(0, 1000),
       trail=st.sampled_from([(), (3,), (2, 2)]))
def test_roundtrip_every_dtype_and_ragged(tmp_path_factory, cls, dtype_idx, sizes, seed, trail):
    g = torch.Generator().manual_seed(seed)
    path = tmp_path_factory.mktemp("s") / "store"
    store = cls(path, ragged_keys=[("r", "x"), ("r", "y")])
    written = []
    for n in sizes:
        rows = []
        for _ in range(n):
            d = {f"f{i}": _rand(trail, DTYPES[j], g) for i, j in enumerate(dtype_idx)}
            d["r"] = {"x": _rand((int(torch.randint(0, 6, (), generator=g)), 2), DTYPES[dtype_idx[0]], g),
                      "y": _rand((int(torch.randint(0, 6, (), generator=g)),), DTYPES[dtype_idx[-1]], g)}
            rows.append(TensorDict(d, batch_size=[]))
        td = lazy_stack(rows, 0)
        idx = store.append_group(td)
        written.extend(rows)
        assert idx.tolist() == list(range(len(written) - n, len(written)))
    assert len(store) == len(written)
    perm = torch.randperm(len(written), generator=g)
    out = store.get(perm)
    for k, i in enumerate(perm.tolist()):
        for key in written[i].keys(True, True):
            a, b = out[k].get(key), written[i].get(key)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    # the same rows read back right-padded (one dense TensorDict, lengths beside)
    padded = cls(path, create=False, ragged_layout="padded").get(perm)
    assert type(padded) is TensorDict
    for k, i in enumerate(perm.tolist()):
        for key in written[i].keys(True, True):
            a, b = padded[k].get(key), written[i].get(key)
            if key[0] == "r":
                assert padded[k].get(("lengths", *key)).item() == b.shape[0]
                assert torch.equal(a[tuple(slice(0, s) for s in b.shape)], b), key
                assert not a[b.shape[0]:].any(), key  # padding is zeros
            else:
                assert torch.equal(a, b), key


@pytest.mark.parametrize("cls", BACKENDS)
def test_nested_layout_gives_jagged_tensors_equal_to_the_rows(tmp_path, cls):
    store = cls(tmp_path / "s", ragged_keys=RAGGED_KEYS)
    for gid in range(5):
        store.append_group(llm_group(gid, n=3))
    idx = torch.randperm(len(store), generator=torch.Generator().manual_seed(0))
    rows = cls(tmp_path / "s", create=False, ragged_layout="rows").get(idx)
    nested = store.get(idx)  # the default for 1-D ragged fields
    assert store.ragged_layout == "nested"
    assert type(nested) is TensorDict and nested.batch_size == rows.batch_size
    response, log_probs = nested.get(("tokens", "response")), nested.get(("log_probs", "rollout"))
    assert response.offsets() is log_probs.offsets()  # equal row lengths: one ragged dim, ops across them
    assert (response * 0 + log_probs).values().shape == log_probs.values().shape
    for key in rows[0].keys(True, True):
        col = nested.get(key)
        if key in [tuple(k) if isinstance(k, tuple) else (k,) for k in RAGGED_KEYS]:
            assert col.is_nested
            assert torch.equal(col.offsets().diff(), torch.tensor([rows[k].get(key).shape[0]
                                                                    for k in range(len(idx))]))
            for k in range(len(idx)):
                assert torch.equal(col[k], rows[k].get(key)), key
        else:
            assert torch.equal(col, rows.get(key)), key


def test_nested_layout_refuses_multidimensional_ragged_fields_in_plain_words(tmp_path):
    store = ArrowStorage(tmp_path / "s", ragged_keys=[("r",)])
    store.append_group(lazy_stack([TensorDict(r=torch.zeros(k + 1, 2), batch_size=[]) for k in range(2)], 0))
    with pytest.raises(SchemaError, match="1-D real ragged fields only"):
        ArrowStorage(tmp_path / "s", create=False, ragged_layout="nested").get(torch.arange(2))


@pytest.mark.parametrize("cls", BACKENDS)
def test_dense_groups_roundtrip_as_dense(tmp_path, cls):
    s = cls(tmp_path / "s")
    td = TensorDict(obs=torch.randn(5, 4), action=torch.randint(0, 3, (5,)), batch_size=[5])
    s.append_group(td)
    s.append_group(td * 2 if False else td.apply(lambda x: x + 1))
    out = s.get(slice(None))
    assert isinstance(out, TensorDict) and out.shape == (10,)
    assert torch.equal(out["obs"][:5], td["obs"]) and torch.equal(out["action"][5:], td["action"] + 1)
    assert torch.equal(s.get(7)["obs"], td["obs"][2] + 1)
    assert torch.equal(s.read_column("action", torch.tensor([6, 0])), torch.stack([td["action"][1] + 1,
                                                                                   td["action"][0]]))
    out["obs"].add_(100)  # an in-place edit of a sample never reaches the store
    assert torch.equal(s.get(slice(0, 5))["obs"], td["obs"])


@pytest.mark.parametrize("cls", BACKENDS)
def test_schema_change_raises_and_writes_nothing(tmp_path, cls):
    s = cls(tmp_path / "s", ragged_keys=RAGGED_KEYS)
    s.append_group(llm_group(0))
    bad_key = llm_group(1)
    bad_key.set("extra", torch.zeros(4))
    with pytest.raises(SchemaError, match="extra"):
        s.append_group(bad_key)
    bad_dtype = llm_group(2)
    bad_dtype.set("policy_version", bad_dtype.get("policy_version").float())
    with pytest.raises(SchemaError, match="policy_version.*dtype"):
        s.append_group(bad_dtype)
    bad_shape = llm_group(3)
    bad_shape.set("advantage", torch.zeros(4, 2))
    with pytest.raises(SchemaError, match="advantage.*shape"):
        s.append_group(bad_shape)
    assert len(s) == 4 and s.group_spans().shape == (1, 3)
    assert len(open_storage(tmp_path / "s")) == 4


def test_undeclared_ragged_key_gets_a_fix(tmp_path):
    s = ArrowStorage(tmp_path / "s")
    s.append_group(TensorDict(x=torch.zeros(2, 3), batch_size=[2]))
    with pytest.raises(SchemaError, match="ragged_keys"):
        s.append_group(lazy_stack([TensorDict(x=torch.zeros(3)), TensorDict(x=torch.zeros(4))], 0))


def test_store_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        ArrowStorage(f)
    d = tmp_path / "other"
    d.mkdir()
    (d / "junk").write_text("x")
    with pytest.raises(StoreError, match="not an rbpipe store"):
        open_storage(d)
    with pytest.raises(StoreError, match="non-empty directory"):
        ArrowStorage(d)
    ArrowStorage(tmp_path / "s").append_group(llm_group(0))
    meta = json.loads((tmp_path / "s" / META_FILE).read_text())
    meta["format_version"] = 999
    (tmp_path / "s" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="format_version 999"):
        open_storage(tmp_path / "s")
    ZarrStorage(tmp_path / "z")
    with pytest.raises(StoreError, match="'zarr' backend"):
        ArrowStorage(tmp_path / "z")


@pytest.mark.parametrize("cls", BACKENDS)
def test_retention_evicts_whole_oldest_groups(tmp_path, cls):
    s = cls(tmp_path / "s", max_size=10, ragged_keys=RAGGED_KEYS)
    for gid in range(6):
        s.append_group(llm_group(gid, n=3 + gid % 2))
        spans = s.group_spans()
        assert len(s) <= 10 or spans.shape[0] == 1
        assert int(spans[0, 1]) == 0 and int(spans[-1, 2]) == len(s)
    gids = s.get(slice(None))["group_id"].tolist()
    # whole groups only, newest kept, row 0 is the oldest surviving row
    assert gids == sorted(gids) and all(gids.count(g) == 3 + g % 2 for g in set(gids)) and gids[-1] == 5
    assert len(open_storage(tmp_path / "s")) == len(s)


def test_max_bytes_and_empty(tmp_path):
    s = ArrowStorage(tmp_path / "s", max_bytes=5000, ragged_keys=RAGGED_KEYS)
    for gid in range(10):
        s.append_group(llm_group(gid))
    assert 0 < len(s) < 40 and len(s) % 4 == 0
    s._empty()
    assert len(s) == 0 and s.group_spans().shape == (0, 3)


@pytest.mark.parametrize("cls", BACKENDS)
def test_pickle_and_state_dict_reopen(tmp_path, cls):
    s = cls(tmp_path / "s", ragged_keys=RAGGED_KEYS)
    s.append_group(llm_group(0))
    s2 = pickle.loads(pickle.dumps(s))
    s2.append_group(llm_group(1))
    assert len(s) == 8 and len(s2) == 8
    other = cls(tmp_path / "t", ragged_keys=RAGGED_KEYS)
    other.load_state_dict(s.state_dict())
    assert len(other) == 8 and other.path == s.path


def test_catalog_inspect_and_export(tmp_path):
    s = ArrowStorage(tmp_path / "s", ragged_keys=RAGGED_KEYS, catalog_every=2)
    groups = [llm_group(g) for g in range(5)]
    for td in groups:
        s.append_group(td)
    table = read_catalog(tmp_path / "s")
    assert table.num_rows == 5 and table.column("members").to_pylist() == [4] * 5
    assert len(list((tmp_path / "s" / "catalog").glob("*.parquet"))) == 2  # 4 flushed, 1 pending
    info = inspect_store(tmp_path / "s", where="group_id >= 3")
    assert [g["group_id"] for g in info["groups"]] == [3, 4] and info["rows"] == 20
    g3 = info["groups"][0]
    assert g3["returns"] == [3.0, 4.0, 5.0, 6.0]
    assert g3["lengths"] == [float(groups[3][i]["tokens", "response"].shape[0]) for i in range(4)]
    assert inspect_store(tmp_path / "s", where="list_avg(returns) > 4.4")["groups_matched"] == 2
    with pytest.raises(StoreError, match="not a SQL condition"):
        inspect_store(tmp_path / "s", where="__import__('os')")
    s.close()
    assert export_zarr(tmp_path / "s", tmp_path / "z") == 5
    z = open_storage(tmp_path / "z")
    assert isinstance(z, ZarrStorage) and len(z) == 20
    assert torch.equal(z.get(13)["tokens", "response"], groups[3][1]["tokens", "response"])


def test_rows_drawn_from_a_snapshot_read_without_refresh_and_new_rows_refresh(tmp_path):
    """Samplers call len() and then get(index): rows within that snapshot are read as they were then; a row
    committed since by another handle is found (the read refreshes) instead of raising out of range."""
    writer = ArrowStorage(tmp_path / "s")
    writer.append_group(llm_group(0))
    reader = ArrowStorage(tmp_path / "s", create=False)
    n = len(reader)
    writer.append_group(llm_group(1))
    first = reader.get(torch.arange(n))
    assert first["group_id"].tolist() == [0] * n
    newest = reader.get(torch.tensor([n, n + 1]))
    assert newest["group_id"].tolist() == [1, 1] and len(reader) == 2 * n
    with pytest.raises(IndexError, match="out of range"):
        reader.get(torch.tensor([4 * n]))
