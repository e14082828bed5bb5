"""torchrl samplers through a plain ReplayBuffer, third-party reading per docs/FORMAT.md, writer lock."""

from __future__ import annotations

import json
import os
import socket

import pyarrow as pa
import pytest
import torch
from helpers_storage import llm_group
from tensordict import TensorDict
from torchrl.data import ReplayBuffer
from torchrl.data.replay_buffers.samplers import PromptGroupSampler, RandomSampler, SamplerWithoutReplacement

from rbpipe.errors import StoreLockedError
from rbpipe.storage import ArrowStorage, GroupWriter, StoreLock, ZarrStorage, collate_identity
from rbpipe.storage.commitlog import decode
from rbpipe.trajectory import RAGGED_KEYS


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
@pytest.mark.parametrize("sampler", ["random", "without", "prompt"])
def test_torchrl_samplers(tmp_path, cls, sampler):
    s = cls(tmp_path / "s", ragged_keys=RAGGED_KEYS)
    smp = {"random": RandomSampler(), "without": SamplerWithoutReplacement(),
           "prompt": PromptGroupSampler(num_groups=2, group_key="group_id")}[sampler]
    rb = ReplayBuffer(storage=s, writer=GroupWriter(), sampler=smp, collate_fn=collate_identity)
    for g in range(5):
        idx = rb.extend(llm_group(g))
        assert idx.tolist() == list(range(4 * g, 4 * g + 4))
    assert len(rb) == 20
    if sampler == "without":
        seen = torch.cat([rb.sample(5)["group_id"] for _ in range(4)])
        assert sorted(seen.tolist()) == sorted(g for g in range(5) for _ in range(4))
    elif sampler == "prompt":
        batch = rb.sample(8)
        gids = batch["group_id"].tolist()
        assert len(set(gids)) == 2 and all(gids.count(g) == 4 for g in set(gids))
    else:
        batch, info = rb.sample(6, return_info=True)
        assert batch["group_id"].tolist() == (info["index"] // 4).tolist()


def test_store_readable_with_pyarrow_and_zarr_alone(tmp_path):
    """Follows docs/FORMAT.md step by step, without rbpipe's readers."""
    groups = [llm_group(g) for g in range(3)]
    a = ArrowStorage(tmp_path / "a", ragged_keys=RAGGED_KEYS)
    z = ZarrStorage(tmp_path / "z", ragged_keys=RAGGED_KEYS)
    for td in groups:
        a.append_group(td)
        z.append_group(td)
    a.close()
    for store in ("a", "z"):
        root = tmp_path / store
        meta = json.loads((root / "rbpipe-store.json").read_text())
        assert meta["format_version"] == 1
        recs = [decode(line) for line in (root / "commits.jsonl").read_bytes().splitlines()]
        assert all(r is not None for r in recs)
        # the same check by hand: crc32 of the JSON text, 8 hex digits, space
        import zlib
        line = (root / "commits.jsonl").read_bytes().splitlines()[1]
        assert int(line[:8], 16) == zlib.crc32(line[9:])
        grecs = [r for r in recs if r["t"] == "group"]
        for g, rec in enumerate(grecs):
            loc = rec["loc"]
            if meta["backend"] == "arrow":
                seg = root / "segments" / (loc["seg"] + ".arrows")
                buf = pa.py_buffer(seg.read_bytes())
                schema = pa.ipc.read_schema(pa.BufferReader(buf))
                batch = pa.ipc.read_record_batch(pa.ipc.read_message(buf.slice(loc["off"], loc["len"])), schema)
                resp = batch.column("tokens.response").to_pylist()
                shapes = batch.column("tokens.response.__shape").to_pylist()
                rewards = batch.column("next.reward").to_pylist()
            else:
                import zarr
                zg = zarr.open_group(str(root / "data.zarr"), mode="r")
                r0 = loc["row"]
                starts = zg["tokens.response.start"][r0:r0 + rec["n"]]
                shapes = zg["tokens.response.shape"][r0:r0 + rec["n"]].tolist()
                resp = [zg["tokens.response.values"][s:s + sh[0]].tolist()
                        for s, sh in zip(starts, shapes, strict=True)]
                rewards = zg["next.reward"][r0:r0 + rec["n"]].tolist()
            for i in range(4):
                assert resp[i] == groups[g][i]["tokens", "response"].tolist()
                assert shapes[i] == [groups[g][i]["tokens", "response"].shape[0]]
                assert rewards[i] == groups[g][i]["next", "reward"].tolist()
    import pyarrow.parquet as pq
    cat = pq.read_table(tmp_path / "a" / "catalog")
    assert sorted(cat.column("group_id").to_pylist()) == [0, 1, 2]


def test_compact_keeps_data_and_serves_rows(tmp_path):
    s = ArrowStorage(tmp_path / "s")
    for g in range(6):
        s.append_group(TensorDict(obs=torch.full((3, 2), float(g)), batch_size=[3]))
    s.close()
    before = s.get(slice(None))
    assert s.compact() == 6
    assert len(list((tmp_path / "s" / "segments").glob("*.arrows"))) == 1
    assert torch.equal(s.get(slice(None))["obs"], before["obs"])
    idx = torch.randperm(18)
    assert torch.equal(s.get(idx)["obs"], before["obs"][idx])
    s2 = ArrowStorage(tmp_path / "s")
    s2.append_group(TensorDict(obs=torch.full((3, 2), 9.0), batch_size=[3]))
    assert s2.get(slice(None))["obs"][:, 0].tolist() == [float(g) for g in range(6) for _ in range(3)] + [9.0] * 3


def test_sampling_after_compaction_and_eviction_returns_the_live_rows(tmp_path):
    s = ArrowStorage(tmp_path / "s", max_size=12)

    def check(groups):  # every live row, in random order, is the one of its group
        want = torch.tensor([float(g) for g in groups for _ in range(3)])
        idx = torch.randperm(len(want))
        assert len(s) == len(want)
        assert torch.equal(s.get(idx)["obs"][:, 0], want[idx])

    for g in range(6):
        s.append_group(TensorDict(obs=torch.full((3, 2), float(g)), batch_size=[3]))
    check([2, 3, 4, 5])
    s.compact()  # one block
    check([2, 3, 4, 5])
    s.append_group(TensorDict(obs=torch.full((3, 2), 6.0), batch_size=[3]))
    check([3, 4, 5, 6])  # the compacted block minus its evicted head, plus a new one
    s.compact()
    check([3, 4, 5, 6])


def test_writer_lock(tmp_path):
    lock = StoreLock(tmp_path)
    with lock:
        holder = json.loads((tmp_path / ".lock").read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(StoreLockedError, match=str(os.getpid())):
            StoreLock(tmp_path).acquire()
    assert not (tmp_path / ".lock").exists()
    # a pid in the file is not a lock: only a process holding its flock is (pid 1 is alive, and holds nothing)
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname()}))
    with StoreLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    # a lock left by a dead process is locked again
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    (tmp_path / ".lock").write_text(json.dumps({"pid": p.pid, "host": socket.gethostname()}))
    with StoreLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
