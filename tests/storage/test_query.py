"""``rbpipe.storage.query``: DuckDB views over a store agree with what the storage itself reads back."""

from __future__ import annotations

import pytest
from helpers_storage import llm_group

from rbpipe.errors import StoreError
from rbpipe.storage import ArrowStorage, ZarrStorage
from rbpipe.storage.query import query

RAGGED = [("tokens", "prompt"), ("tokens", "response"), ("log_probs", "rollout")]


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
@pytest.mark.parametrize("max_size", [None, 30])
def test_trajectories_view_matches_stored_rows(tmp_path, cls, max_size):
    store = cls(tmp_path / "s", ragged_keys=RAGGED, max_size=max_size, ragged_layout="padded")
    for gid in range(12):
        store.append_group(llm_group(gid, n=2 + gid % 3))
    store.close()
    rows = store.get(slice(None))
    got = query(tmp_path / "s", "select group_id, next_reward, tokens_response_len, member "
                                "from trajectories order by seq, member").to_pydict()
    assert got["group_id"] == rows["group_id"].tolist()
    assert got["next_reward"] == rows["next", "reward"].reshape(-1).tolist()
    assert got["tokens_response_len"] == rows["lengths", "tokens", "response"].tolist()
    spans = store.group_spans()
    assert got["member"] == [m for _, a, b in spans.tolist() for m in range(b - a)]


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_groups_view_is_complete_and_marks_evicted(tmp_path, cls):
    store = cls(tmp_path / "s", ragged_keys=RAGGED, max_size=8, catalog_every=1000)  # nothing flushed yet
    for gid in range(5):
        store.append_group(llm_group(gid, n=4))
    out = query(tmp_path / "s", "select count(*) as n, count(*) filter (where live) as live, "
                                "sum(members) filter (where live) as rows from groups").to_pylist()[0]
    assert out == {"n": 5, "live": 2, "rows": len(store)}
    store.close()


def test_bad_sql_and_bad_store_are_one_line_errors(tmp_path):
    store = ArrowStorage(tmp_path / "s", ragged_keys=RAGGED)
    store.append_group(llm_group(0))
    store.close()
    with pytest.raises(StoreError, match="query failed: .*nope") as err:
        query(tmp_path / "s", "select nope from trajectories")
    assert "\n" not in str(err.value)
    with pytest.raises(StoreError, match="not an rbpipe store"):
        query(tmp_path, "select 1")


def test_empty_store_has_empty_views(tmp_path):
    ArrowStorage(tmp_path / "s").close()
    assert query(tmp_path / "s", "select count(*) as n from trajectories").to_pylist() == [{"n": 0}]
    assert query(tmp_path / "s", "select count(*) as n from groups").to_pylist() == [{"n": 0}]


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_string_fields_are_queryable_as_text(tmp_path, cls):
    """torchrl's LLM data keeps its prompt as a string leaf (``"query"``): the view shows the text itself."""
    import torch
    from tensordict import NonTensorData, TensorDict, lazy_stack

    texts = [["2+2=", "2+2= "], ["héllo\nwörld", ""]]
    store = cls(tmp_path / "s")
    for gid, group in enumerate(texts):
        store.append_group(lazy_stack([TensorDict({"group_id": torch.tensor(gid), "query": NonTensorData(t)},
                                                  batch_size=[]) for t in group], 0))
    store.close()
    got = query(tmp_path / "s", "select group_id, query from trajectories order by seq, member").to_pylist()
    assert got == [{"group_id": g, "query": t} for g, group in enumerate(texts) for t in group]
