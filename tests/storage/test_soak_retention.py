"""Soak: writer processes append with retention (one is SIGKILLed midway), a compactor runs, readers sample
whole groups. Every group read is exact, no acknowledged group is lost, data on disk stays within the bound
of docs/FORMAT.md ("Retention and disk"). Every phase ends on a count or an event, never on a time: the writers
write ``GROUPS_PER_WRITER`` groups each (the one killed stops itself in the middle of its group after
``KILL_AFTER``, its data written and its commit line not, and is SIGKILLed there), and the readers stop once each
has checked groups."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter

import multiprocess
import pytest
import torch

from rbpipe.sampling import FreshGroupSampler
from rbpipe.storage import ArrowStorage, ZarrStorage, open_storage
from rbpipe.storage.commitlog import CommitLog
from rbpipe.storage.retention import data_bytes, disk_bound

RAGGED = [("tokens",)]
MAX_ROWS = 4 * 16
WRITERS = 3
GROUPS_PER_WRITER = 40  # the writers that are not killed
KILL_AFTER = 25  # committed groups of writer 0, then SIGKILL in the middle of its next one


def _member(gid: int, i: int):
    from tensordict import TensorDict
    n = 40 + (gid * 7 + i * 13) % 300
    return TensorDict({"group_id": torch.tensor(gid), "member": torch.tensor(i),
                       "tokens": torch.arange(n, dtype=torch.int64) + gid * 1000 + i,
                       "policy_version": torch.tensor(0)}, batch_size=[])


def _group(gid: int):
    from tensordict import lazy_stack
    return lazy_stack([_member(gid, i) for i in range(4)], 0)


def _check_rows(td) -> list[int]:
    """The group ids of ``td`` (whole groups of 4), after checking every row against what was written."""
    gids, members = td["group_id"].tolist(), td["member"].tolist()
    rows = td["tokens"].unbind(0)  # a jagged nested tensor (the default layout)
    for k, (gid, member) in enumerate(zip(gids, members, strict=True)):
        assert member == k % 4 and gid == gids[k - k % 4], f"torn group at row {k}: {gids}"
        assert torch.equal(rows[k], _member(gid, member)["tokens"]), f"row {k} of group {gid} has other data"
    return gids[::4]


def _writer(path: str, cls_name: str, wid: int, ack_path: str, groups: int, freeze: bool = False) -> None:
    """Append ``groups`` groups, acknowledging each in ``ack_path`` once committed; with ``freeze``, stop this
    process (SIGSTOP) in the next group's append, between its data and its commit line, for the test to kill."""
    import rbpipe.storage as st
    from rbpipe.storage.ledger import Ledger

    if freeze:
        commit_group = Ledger.commit_group

        def frozen(self, *args, **kwargs):
            if k == groups:
                os.kill(os.getpid(), signal.SIGSTOP)
            return commit_group(self, *args, **kwargs)

        Ledger.commit_group = frozen
    s = getattr(st, cls_name)(path, create=False, max_size=MAX_ROWS, ragged_keys=RAGGED)
    with open(ack_path, "a") as ack:
        k = 0
        while k < groups + freeze:
            gid = wid * 1_000_000 + k
            s.append_group(_group(gid))
            ack.write(f"{gid}\n")  # acknowledged: append_group returned
            ack.flush()
            k += 1
    s.close()


def _compactor(path: str, cls_name: str, stop) -> None:
    import rbpipe.storage as st
    s = getattr(st, cls_name)(path, create=False, ragged_keys=RAGGED)
    while not stop.is_set():
        s.compact()
        time.sleep(0.05)


def _reader(path: str, out_path: str, stop, read_some) -> None:
    s = open_storage(path)
    sampler = FreshGroupSampler(num_groups=3, consume=False)
    checked = 0
    while not stop.is_set():
        if not sampler.can_sample(s):
            time.sleep(0.01)
            continue
        index, _ = sampler.sample(s)
        td = s.get(index)  # after the sampler's hold: never a StaleReadError here
        checked += len(_check_rows(td))
        read_some.set()
    with open(out_path, "w") as f:
        f.write(f"{checked}\n")


def _listing(path, store, on_disk: int, bound: int) -> str:
    """What is on disk against the bound, file by file (size, allocated bytes), and which live groups each
    Arrow segment holds: enough to tell which rule of the bound a failure broke."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(full)
                files[os.path.relpath(full, path)] = [st.st_size, st.st_blocks * 512]
    live = Counter(r["loc"].get("seg") for r in store._ledger.groups.values())
    return json.dumps({"on_disk": on_disk, "bound": bound, "live_bytes": store.live_bytes,
                       "files": files, "live_groups_per_segment": live})


def _committed(path) -> tuple[dict[int, int], int]:
    """gid -> seq of every committed group, and the highest evicted seq."""
    log = CommitLog(path / "commits.jsonl")
    gids, evicted = {}, -1
    for rec in log.read_new():
        if rec.get("t") == "group":
            gids[int(rec["gid"])] = rec["seq"]
        elif rec.get("t") == "evict":
            evicted = max(evicted, rec["upto"])
    log.close()
    return gids, evicted


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_soak_readers_writers_compactor_with_retention(tmp_path, cls):
    path = tmp_path / "s"
    store = cls(path, max_size=MAX_ROWS, ragged_keys=RAGGED)
    store.append_group(_group(999_999_999))
    ctx = multiprocess.get_context("spawn")
    stop, read_some = ctx.Event(), ctx.Event()
    acks = [tmp_path / f"ack{w}" for w in range(WRITERS)]
    procs = [ctx.Process(target=_writer, args=(str(path), cls.__name__, w, str(acks[w]),
                                               KILL_AFTER if w == 0 else GROUPS_PER_WRITER, w == 0))
             for w in range(WRITERS)]
    procs.append(ctx.Process(target=_compactor, args=(str(path), cls.__name__, stop)))
    procs.append(ctx.Process(target=_reader, args=(str(path), str(tmp_path / "reader"), stop, read_some)))
    sampler = FreshGroupSampler(num_groups=2, consume=False)
    checked, worst = 0, 0.0
    try:
        for p in procs:
            p.start()
        killed, start = False, time.monotonic()
        # until writer 0 was killed, the others wrote their groups and this process checked some: counts, not
        # times (on a loaded machine starting the five processes alone took ~2 min; a writer that hangs is caught
        # by the test's timeout)
        while not killed or any(p.is_alive() for p in procs[1:WRITERS]) or checked <= 20:
            if not killed:
                done, status = os.waitpid(procs[0].pid, os.WNOHANG | os.WUNTRACED)
                assert not done or os.WIFSTOPPED(status), f"writer 0 ended before its freeze point ({status})"
                if done:  # stopped at its point: killed mid-write, its files must go too
                    os.kill(procs[0].pid, signal.SIGKILL)
                    killed = True
            if sampler.can_sample(store):
                index, _ = sampler.sample(store)
                checked += len(_check_rows(store.get(index)))
            # this process appended too (one writer more); the live bytes move while the files are listed, so
            # the bound is taken on both sides of the listing; a compaction in flight adds its output (at most
            # the live bytes) until it deletes the old files
            before = disk_bound(store, writers=WRITERS + 1) + store.live_bytes
            on_disk = data_bytes(path)
            bound = max(before, disk_bound(store, writers=WRITERS + 1) + store.live_bytes)
            worst = max(worst, on_disk / bound)
            assert on_disk <= bound, _listing(path, store, on_disk, bound)
        assert read_some.wait(300), "the reader process checked no group"
        stop.set()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [-signal.SIGKILL] + [0] * (len(procs) - 1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    print(f"soak {cls.__name__}: {time.monotonic() - start:.1f}s, acks {[len(a.read_text().split()) for a in acks]}, "
          f"checked {checked}, worst disk/bound {worst:.2f}")
    assert checked > 20
    reader_checked = int((tmp_path / "reader").read_text().split()[0])
    assert reader_checked > 0

    # no acknowledged group is lost: each one is live (and reads back exact) or was evicted
    committed, evicted = _committed(path)
    final = cls(path, create=False, max_size=MAX_ROWS, ragged_keys=RAGGED)
    live = _check_rows(final.get(slice(None)))
    assert len(live) == len(set(live)) and set(live) <= set(committed)
    for ack in acks:
        for gid in map(int, ack.read_text().split()):
            assert gid in committed, f"acknowledged group {gid} was never committed"
            assert gid in live or committed[gid] <= evicted, f"acknowledged group {gid} vanished"
    assert sorted(committed[g] for g in live) == [s for s in sorted(committed.values()) if s > evicted]

    # groups enough to evict every earlier one (whichever writer finished last): the sweep must then leave
    # nothing of the killed writer
    for gid in range(MAX_ROWS // 4):
        final.append_group(_group(999_000_000 + gid))
    final.compact()
    final.append_group(_group(999_999_997))
    assert data_bytes(path) <= disk_bound(final, writers=1), (data_bytes(path), disk_bound(final, writers=1))
    if cls is ArrowStorage:
        dead = [p.name for p in (path / "segments").glob("*.inprogress") if f"-{os.getpid()}-" not in p.name]
        assert dead == [], "a killed writer's segment outlived its groups"
