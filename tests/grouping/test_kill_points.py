"""Kill + resume at every point of a hand-over (issue 33). A writer process is SIGKILLed by itself at one point
of its path: after staging a payload, after the registry's answer, before loading a claim, before or after the
store's commit, after the confirmation and before or halfway through deleting the staged payloads. Then a fresh
registry (the killed service's state is gone) resumes from the staging directory as ``rbpipe serve`` does, the
trajectories never handed over are handed over, and the store is checked: every group stored once and whole,
every trajectory once, nothing left staged. The kill fires at a point of the writer's own path, never after a
delay: the test cannot race the machine's speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rbpipe.buffer import make_replay_buffer
from rbpipe.grouping.manager import manager_address
from rbpipe.storage import ArrowStorage
from tests.grouping.helpers import MINIMAL_KEYS, traj

ROOT = Path(__file__).resolve().parents[2]
GROUPS, SIZE = 4, 2
#: trajectory i: (uid, group, rewards), the groups interleaved so that claims and queued groups mix
ITEMS = [(i, i % GROUPS, [float(i % 3 == 0)]) for i in range(GROUPS * SIZE)]

_WRITER = textwrap.dedent("""
    import json, os, signal, sys
    import rbpipe.grouping.transform as transform
    from rbpipe.buffer import make_replay_buffer
    from rbpipe.grouping.staging import Staging
    from rbpipe.storage import ArrowStorage
    from tests.grouping.helpers import MINIMAL_KEYS, traj
    args = json.loads(sys.argv[1])
    point, hits = args["point"], [0]

    def maybe_die(here):
        if here == point:
            hits[0] += 1
            if hits[0] == args["nth"]:
                os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, before=None, after=None):
        orig = getattr(owner, name)
        def wrapped(*a, **k):
            if before: maybe_die(before)
            out = orig(*a, **k)
            if after: maybe_die(after)
            return out
        setattr(owner, name, wrapped)

    wrap(Staging, "put", after="staged")
    wrap(transform.SharedMCAdvantage, "load", before="load")
    wrap(ArrowStorage, "append_group", before="commit", after="committed")
    call = transform.call
    def calling(proxy, method, *a):
        out = call(proxy, method, *a)
        maybe_die(method)  # "append_many": answered; "confirm_many": confirmed, payloads not deleted yet
        return out
    transform.call = calling
    delete = Staging.delete
    def deleting(self, handles):
        handles = list(handles)
        if point == "deleting" and len(handles) > 1:
            delete(self, handles[:1])  # halfway through
            maybe_die("deleting")
        delete(self, handles)
    Staging.delete = deleting

    from rbpipe.grouping.manager import connect_manager
    manager = connect_manager(args["address"], bytes.fromhex(args["authkey"]))
    buffer = make_replay_buffer(ArrowStorage(args["store"]), grpo_size=2, manager=manager, name=args.get("name"),
                                staging_dir=os.path.join(args["store"], "staging"), required_keys=MINIMAL_KEYS)
    for uid, group, rewards in args["items"]:
        buffer.extend(traj(uid, group, rewards))
    print("not killed", flush=True)
""")

POINTS = [("staged", 3), ("append_many", 4), ("load", 2), ("commit", 1), ("committed", 2), ("confirm_many", 1),
          ("deleting", 2)]


def _run_writer(args: dict) -> None:
    out = subprocess.run([sys.executable, "-c", _WRITER, json.dumps(args)], cwd=ROOT, capture_output=True, text=True,
                         timeout=100, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == -9, (f"the writer was not killed at {args['point']!r} #{args['nth']}: "
                                  f"{out.stdout[-2000:]}{out.stderr[-2000:]}")


def _resume_and_finish(store: Path, manager, name: str) -> ArrowStorage:
    """What a resumed service does (requeue what is staged, into a fresh registry: the killed service's state is
    gone), then hand over what never was; returns the store."""
    storage = ArrowStorage(store)
    buffer = make_replay_buffer(storage, grpo_size=2, manager=manager, staging_dir=store / "staging",
                                name=name, required_keys=MINIMAL_KEYS)
    buffer.requeue_staged()
    t = buffer.grouping_transform
    staged = {int(t.staging.load(h).get("uid")[0]) for h in t.staging.handles()}
    stored = set(storage[:len(storage)].get("uid").reshape(-1).tolist()) if len(storage) else set()
    for uid, group, rewards in ITEMS:
        if uid not in staged | stored:  # never handed over: its collector generates it again
            buffer.extend(traj(uid, group, rewards))
    buffer.confirm_stored()
    assert t.get_stats()["queued_trajectories"] == 0
    t.close()
    return storage


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,nth", POINTS)
def test_a_kill_at_any_point_then_a_resume_stores_each_group_once(tmp_path, grouping_manager, point, nth):
    store = tmp_path / "store"
    address, authkey = manager_address(grouping_manager)
    _run_writer(dict(store=str(store), point=point, nth=nth, items=ITEMS, address=address, authkey=authkey.hex(),
                     name=f"killed-at-{point}"))  # the killed service's registry: never used again
    storage = _resume_and_finish(store, grouping_manager, f"resumed-after-{point}")
    rows = storage[:len(storage)]
    uids = rows.get("uid").reshape(-1).tolist()
    assert sorted(uids) == sorted(uid for uid, _, _ in ITEMS), "a trajectory was lost or stored twice"
    spans = storage.group_spans().tolist()
    gids = rows.get("group_id").reshape(-1).tolist()
    groups = [gids[a] for _, a, b in spans]
    assert sorted(groups) == list(range(GROUPS)), f"a group id stored twice or missing: {groups}"
    assert all(b - a == SIZE and len(set(gids[a:b])) == 1 for _, a, b in spans)
    leftover = [p for p in (store / "staging").glob("*/*.td")]
    assert leftover == [], f"staged payloads of stored groups left behind: {leftover}"


@pytest.mark.timeout(120)
def test_payloads_of_a_group_stored_and_confirmed_by_a_killed_writer_are_deleted_at_the_end(tmp_path,
                                                                                              grouping_manager):
    """No resume: the service lives on, and at its end (``confirm_stored``) nothing of a stored group stays
    staged, although no claim names the payloads any more (the writer confirmed, then was killed)."""
    store = tmp_path / "store"
    storage = ArrowStorage(store)
    buffer = make_replay_buffer(storage, grpo_size=2, manager=grouping_manager, staging_dir=store / "staging",
                                name="killed-after-confirm", required_keys=MINIMAL_KEYS)
    address, authkey = manager_address(grouping_manager)
    _run_writer(dict(store=str(store), point="confirm_many", nth=1, items=ITEMS[:GROUPS + 1], address=address,
                     authkey=authkey.hex(), name="killed-after-confirm"))
    t = buffer.grouping_transform
    assert len(t.staging.handles()) == GROUPS + 1  # the stored group's two, and the three queued
    assert buffer.confirm_stored() == 0  # nothing unconfirmed: the writer confirmed before it was killed
    left = {int(t.staging.load(h).get("uid")[0]) for h in t.staging.handles()}
    assert left == {uid for uid, _, _ in ITEMS[1:GROUPS]}  # the queued ones stay, the stored ones went
    assert len(storage) == SIZE
    t.clear_queues()
