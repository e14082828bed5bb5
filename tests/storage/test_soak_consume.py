"""Soak of the learner's read path under retention: one writer process appends whole groups to a store with
``max_size=40`` (10 groups: evictions at almost every commit), two reader processes sample it as rbpipe's
learner does (``FreshGroupSampler`` with ``consume=True`` and a ``max_staleness``, torchrl's ``ReplayBuffer``
with ``ImmutableDatasetWriter``), and check every row they get. A group read is wrong when its rows are not
all of one group, when a row holds another member's data, or when it is not the group the sampler drew (the
commit log's ``gid`` of the drawn ``seq``); a reader that gets a group twice counts it wrong too.

It runs until the readers have checked ``RBPIPE_SOAK_GROUPS`` groups (default 200 per backend: ~10 s each at
the 10,000-group run's rate, ~100 s measured at load 15-20 on 2 cores), never for a fixed time. The 10,000-group figure
of issue 33 is ``RBPIPE_SOAK_GROUPS=10000 RBPIPE_SOAK_TIMEOUT_S=4000 python -m pytest -s
tests/storage/test_soak_consume.py`` (0 wrong of 10,000 on each backend; the code before it: 26 and 34 wrong of
404 groups, so ~13 and ~17 expected at the default 200)."""

from __future__ import annotations

import os
import time

import multiprocess
import pytest
import torch

from rbpipe.storage import ArrowStorage, ZarrStorage
from rbpipe.storage.ledger import scan

GROUPS = int(os.environ.get("RBPIPE_SOAK_GROUPS", "200"))
MAX_ROWS = 40
MEMBERS = 4
READERS = 2
PER_BATCH = 2
MAX_STALENESS = 1


def _member_tokens(gid: int, member: int) -> torch.Tensor:
    n = 20 + (gid * 7 + member * 13) % 200
    return torch.arange(n, dtype=torch.int64) + gid * 1000 + member


def _group(gid: int, version: int):
    from tensordict import TensorDict, lazy_stack

    rows = [TensorDict({"group_id": torch.tensor(gid), "member": torch.tensor(i), "tokens": _member_tokens(gid, i),
                        # one member sampled a version earlier now and then: the group's oldest counts
                        "policy_version": torch.tensor(max(version - (i == 0 and gid % 3 == 0), 0))},
                       batch_size=[]) for i in range(MEMBERS)]
    return lazy_stack(rows, 0)


def _writer(path: str, cls_name: str, version, stop) -> None:
    import rbpipe.storage as st

    torch.set_num_threads(1)
    store = getattr(st, cls_name)(path, create=False, max_size=MAX_ROWS, ragged_keys=[("tokens",)])
    gid = 0
    while not stop.is_set():
        store.append_group(_group(gid, version.value))
        gid += 1
    store.close()


def _check_batch(td, spans: list[list[int]]) -> list[tuple[int, int, bool]]:
    """(seq, group id read, whether every row of it is exact) per drawn span, in draw order."""
    gids, members = td["group_id"].tolist(), td["member"].tolist()
    tokens = td["tokens"].unbind(0)  # a jagged nested tensor (the default layout)
    out, row = [], 0
    for seq, start, stop in spans:
        n = stop - start
        gid = gids[row]
        ok = n == MEMBERS and gids[row:row + n] == [gid] * n and members[row:row + n] == list(range(n))
        ok = ok and all(torch.equal(tokens[row + i], _member_tokens(gid, i)) for i in range(n))
        out.append((seq, gid, ok))
        row += n
    return out


def _reader(path: str, out_path: str, version, checked, stop) -> None:
    from torchrl.data import ReplayBuffer
    from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter

    from rbpipe.errors import StaleReadError
    from rbpipe.sampling import FreshGroupSampler
    from rbpipe.storage import collate_identity, open_storage

    torch.set_num_threads(1)  # as rbpipe's learner process runs (reads then copy with numpy)
    storage = open_storage(path)
    sampler = FreshGroupSampler(num_groups=PER_BATCH, max_staleness=MAX_STALENESS)
    buffer = ReplayBuffer(storage=storage, sampler=sampler, writer=ImmutableDatasetWriter(),
                          batch_size=PER_BATCH * MEMBERS, collate_fn=collate_identity)
    redraws_exhausted = 0
    with open(out_path, "w") as out:
        while not stop.is_set():
            sampler.consumer_version = version.value
            if not sampler.can_sample(storage):
                time.sleep(0.001)  # waiting for the writer, as the learner waits (not a synchronisation)
                continue
            try:
                td, info = buffer.sample(return_info=True)
            except StaleReadError:  # evicted before they could be held, REDRAWS times: not a wrong group
                redraws_exhausted += 1
                continue
            results = _check_batch(td, info["group_spans"].tolist())
            out.write("".join(f"{seq} {gid} {int(ok)}\n" for seq, gid, ok in results))
            with version.get_lock():
                version.value += 1  # one learner step: the writer stamps the next groups with it
            with checked.get_lock():
                checked.value += len(results)
        out.write(f"# stale_groups {sampler.stale_groups} redraws_exhausted {redraws_exhausted}\n")


@pytest.mark.timeout(int(os.environ.get("RBPIPE_SOAK_TIMEOUT_S", "600")))
@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_learner_sampling_under_retention_reads_exactly_the_drawn_groups(tmp_path, cls):
    path = tmp_path / "s"
    cls(path, ragged_keys=[("tokens",)]).close()
    ctx = multiprocess.get_context("spawn")
    stop, version, checked = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
    outs = [tmp_path / f"reader{r}" for r in range(READERS)]
    procs = [ctx.Process(target=_writer, args=(str(path), cls.__name__, version, stop))]
    procs += [ctx.Process(target=_reader, args=(str(path), str(outs[r]), version, checked, stop))
              for r in range(READERS)]
    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        while checked.value < GROUPS:
            assert all(p.is_alive() for p in procs), f"a soak process died: {[p.exitcode for p in procs]}"
            time.sleep(0.05)  # polling the readers' count; the test ends on the count, not on time
        stop.set()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    seconds = time.monotonic() - start
    gid_of_seq = {seq: rec["gid"] for seq, rec in scan(path).groups.items()}
    total, wrong, stale, exhausted, notes = 0, 0, 0, 0, []
    for out in outs:
        seen: set[int] = set()
        for line in out.read_text().splitlines():
            if line.startswith("#"):
                _, _, s, _, e = line.split()
                stale, exhausted = stale + int(s), exhausted + int(e)
                continue
            seq, gid, ok = map(int, line.split())
            total += 1
            if not ok or gid_of_seq.get(seq) != gid or seq in seen:
                wrong += 1
                if len(notes) < 5:
                    notes.append(f"{out.name}: drew seq {seq} (group {gid_of_seq.get(seq)}), read group {gid}, "
                                 f"rows exact: {bool(ok)}, again: {seq in seen}")
            seen.add(seq)
    written = len(gid_of_seq)
    print(f"\nsoak consume {cls.__name__}: {seconds:.1f}s, {written} groups written, {total} read and checked, "
          f"{wrong} wrong, {stale} retired stale, {exhausted} samples out of redraws")
    assert total >= GROUPS
    assert wrong == 0, notes
    assert written > total  # retention evicted groups the readers never got (the race was on)
