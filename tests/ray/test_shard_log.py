"""The shards' log (``rbpipe.service.ray.shardlog``): JSON lines read back without unpickling. Records round-trip
exactly (tuple group keys, bytes), a torn last line is ignored, anything else that does not decode fails in one
line naming the file, a pickle payload is never run; a shard replays its log (its options from the log, or
re-sent by a router when they could not be written)."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.objectives.llm import MCAdvantageSelector

from rbpipe.errors import ConfigError
from rbpipe.grouping.registry import encode_tensor
from rbpipe.service.ray import shards as shards_mod
from rbpipe.service.ray.shardlog import (
    LOGGED,
    ShardLogError,
    call_record,
    decode_value,
    encode_value,
    open_record,
    read_log,
)
from rbpipe.service.ray.shards import RegistryAwaitsOptions, ShardHost
from rbpipe.system.fault_hooks import SHARD_RESTART_ENV

GROUPS = st.integers() | st.text() | st.tuples(st.integers(-2 ** 31, 2 ** 31), st.integers())
BYTES, DTYPES, SHAPES = (st.binary(max_size=64), st.sampled_from(["float32", "bfloat16", "int64"]),
                         st.tuples(st.integers(0, 9), st.integers(1, 3)))
ENCODED = st.tuples(BYTES, DTYPES, SHAPES)
FIELDS = st.lists(st.tuples(st.tuples(st.text(max_size=5)), ENCODED), max_size=2).map(tuple)
REWARDS = (ENCODED | st.tuples(BYTES, DTYPES, SHAPES, st.integers(1, 99))
           | st.tuples(BYTES, DTYPES, SHAPES, st.none() | st.integers(1, 99), FIELDS))
BUILTIN_OPTIONS = {"grpo_size": 2, "trajectory_return": "sum", "keep_return_bounds": (0.01, 0.99),
                   "candidate_group_size": 3, "candidate_selection_min_size": 3,
                   "candidate_selector": MCAdvantageSelector("first", max_combinations=77)}


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (a tuple stays a tuple, bytes stay bytes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, MCAdvantageSelector):
        return vars(a) == vars(b)
    return a == b


def _log(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "shard-0.log"
    path.write_bytes(b"".join(lines))
    return path


@settings(max_examples=150, deadline=None)
@given(group=GROUPS, handle=st.text(), reward=REWARDS, owner=st.text(), reserve=st.booleans(),
       reason=st.text(), name=st.text(max_size=12))
def test_every_record_kind_reads_back_exactly(tmp_path_factory, group, handle, reward, owner, reserve, reason,
                                              name):
    calls = [("append", (group, handle, reward, owner, reserve)), ("confirm", (handle,)),
             ("quarantine", (handle, reason)), ("reset_stats", ()), ("clear_queues", ())]
    assert sorted(m for m, _ in calls) == sorted(LOGGED)
    staging = {"path": "/store/staging", "temporary": False}
    path = _log(tmp_path_factory.mktemp("log"), [open_record(name, BUILTIN_OPTIONS, staging)]
                + [call_record(name, method, args) for method, args in calls])
    records, end = read_log(path)
    assert end == path.stat().st_size
    assert records[0]["op"] == "open" and records[0]["name"] == name
    assert _same(records[0]["options"], BUILTIN_OPTIONS) and _same(records[0]["staging"], staging)
    for record, (method, args) in zip(records[1:], calls, strict=True):
        assert record["op"] == "call" and record["name"] == name and record["method"] == method
        assert _same(record["args"], args)
    assert hash(records[1]["args"][0]) == hash(group)  # a tuple key finds its queue again


def test_options_with_a_users_selector_are_not_written(tmp_path):
    class KeepFirst(MCAdvantageSelector):
        pass

    options = dict(BUILTIN_OPTIONS, candidate_selector=KeepFirst("first"))
    (record,), _ = read_log(_log(tmp_path, [open_record("r", options, None)]))
    assert record["options"] is None and record["fingerprint"] and record["staging"] is None
    with pytest.raises(TypeError, match="KeepFirst"):
        encode_value(options)


@pytest.mark.parametrize("bad", [{"$pickle": "gASV"}, {"$tuple": [1], "x": 2}, {"a": 1}, {"$bytes": "!!"},
                                 {"$selector": ["greedy", 1]}, {"$dict": [[[1], 2]]},
                                 {"$int": 5}])
def test_an_unknown_or_malformed_tag_is_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        decode_value(bad)


def test_a_torn_last_line_is_ignored(tmp_path):
    lines = [call_record("r", "confirm", (f"claim-{i}",)) for i in range(3)]
    whole = b"".join(lines[:2])
    for cut in range(len(lines[2])):  # killed anywhere while writing the third: it never ran
        records, end = read_log(_log(tmp_path, [whole, lines[2][:cut]]))
        assert [r["args"] for r in records] == [("claim-0",), ("claim-1",)] and end == len(whole)


@pytest.mark.parametrize("corrupt", [
    lambda line: line.replace(b"claim-1", b"claim-9"),  # checksum no longer matches
    lambda line: b"not json at all\n",
    lambda line: b"\n",
])
def test_a_corrupted_line_fails_in_one_line_naming_the_file(tmp_path, corrupt):
    lines = [call_record("r", "confirm", (f"claim-{i}",)) for i in range(3)]
    path = _log(tmp_path, [lines[0], corrupt(lines[1]), lines[2]])
    with pytest.raises(ShardLogError) as err:
        read_log(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "line 2" in message


class _Marker:
    """A pickle that, loaded, creates a file: what a replay must never do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


@pytest.fixture
def no_ray(monkeypatch):
    """ShardHost in this process: no coordinator to notify, this process's torch threads left alone."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(ShardHost, "_appended", lambda self, *args: None)


@pytest.mark.parametrize("where", ["alone", "after records", "as a torn tail"])
def test_a_pickle_payload_in_the_log_is_never_run(tmp_path, no_ray, where):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(("open", "r", {"grpo_size": 2, "x": _Marker(marker)}, None))
    framed = len(payload).to_bytes(8, "little") + payload  # the old format's record
    logs = tmp_path / "logs"
    logs.mkdir()
    good = [open_record("r", {"grpo_size": 2}, None), call_record("r", "reset_stats", ())]
    content = {"alone": [framed], "after records": [*good, framed, b"\n"], "as a torn tail": [*good, framed]}[where]
    path = _log(logs, content)
    with pytest.raises(ShardLogError) as err:
        ShardHost(0, "ns", 5.0, log_dir=str(logs))
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert not marker.exists()
    assert path.read_bytes() == b"".join(content)  # left as it was, for a person to look at


def _reward(*values: float) -> tuple:
    return encode_tensor(torch.tensor(values, dtype=torch.float32).reshape(-1, 1))


def _feed(host: ShardHost) -> dict:
    """Appends of int, str and tuple group keys (some groups complete: claims), a confirm and a quarantine."""
    token = host.leases.grant()
    host.adopt(token)
    done = []
    for i, group in enumerate([7, "prompt-a", (3, 4), 7, "prompt-a", (3, 4), (3, 4), 9]):
        out = host.call("r", "append", (group, f"h{i}", _reward(float(i), 1.0), token, False), {})
        if out["status"] == "write":
            done.append(out["commit_id"])
    assert len(done) == 3
    assert host.call("r", "confirm", (done[0],), {}) is True
    assert host.call("r", "quarantine", (done[1], "disk full"), {})["reason"] == "disk full"
    return host.call("r", "get_stats", (), {})


def _state(host: ShardHost) -> tuple:
    reg = host.registries["r"]
    shard = reg._shards[0]
    return (reg.get_stats(), sorted(reg._claims), reg.drop_reasons(), [q["commit_id"] for q in reg.quarantined()],
            {group: [h for _, h, _ in shard.members[gid]] for group, gid in shard.group_ids.items()})


def test_a_restarted_shard_replays_its_log(tmp_path, no_ray):
    options = dict(BUILTIN_OPTIONS, keep_return_bounds=None, candidate_group_size=None,
                   candidate_selection_min_size=None)
    first = ShardHost(0, "ns", 5.0, log_dir=str(tmp_path))
    first.open("r", options, {"path": "/s", "temporary": False})
    _feed(first)
    again = ShardHost(0, "ns", 5.0, log_dir=str(tmp_path))  # what Ray's restart runs
    assert again.replayed == 11 and _state(again) == _state(first)
    assert _state(again)[-1] == {(3, 4): ["h6"], 9: ["h7"]}
    assert again.open("r", None, None)["options"]["candidate_selector"].strategy == "first"
    out = again.call("r", "append", ((3, 4), "h8", _reward(8.0, 1.0), "t", False), {})
    assert out["status"] == "write" and sorted(out["selected"]) == ["h6", "h8"]  # the tuple key's queue


def test_options_that_were_not_written_are_re_sent_by_a_router(tmp_path, no_ray):
    class KeepFirst(MCAdvantageSelector):
        pass

    options = {"grpo_size": 2, "candidate_selector": KeepFirst("first")}
    first = ShardHost(0, "ns", 5.0, log_dir=str(tmp_path))
    first.open("r", options, None)
    _feed(first)
    again = ShardHost(0, "ns", 5.0, log_dir=str(tmp_path))
    assert again.replayed == 11 and "r" not in again.registries
    with pytest.raises(RegistryAwaitsOptions):
        again.call("r", "get_stats", (), {})
    with pytest.raises(RegistryAwaitsOptions):
        again.open("r", None, None)  # a joiner: it has no options to give
    with pytest.raises(ConfigError, match="other options"):
        again.open("r", dict(options, grpo_size=3), None)
    assert type(again.open("r", options, None)["options"]["candidate_selector"]) is KeepFirst
    assert _state(again) == _state(first)


@pytest.mark.timeout(120)
def test_a_router_re_sends_options_to_a_restarted_shard(ray_cluster, tmp_path):
    """The options of a user's selector are not in the log: after Ray restarts the shard, the router's next
    call re-sends them (it holds them from opening) and the shard's queued trajectory is there again."""
    import ray

    from rbpipe.service.ray import RayManager

    class KeepFirst(MCAdvantageSelector):
        pass

    manager = RayManager.start(shards=1, ttl_s=5.0, log_dir=str(tmp_path), prefix="shardlog-")
    try:
        staging = {"path": str(tmp_path / "staging"), "temporary": False}
        router = manager.get_registry("r", {"grpo_size": 2, "candidate_selector": KeepFirst("first")}, 1, staging)
        token = router.lease()
        assert router.append((1, 2), "h0", _reward(1.0), token)["status"] == "queued"
        shard = manager.shard_actors[0]
        pid = ray.get(shard.pid.remote())
        assert ray.get(shard.__ray_call__.remote(lambda self: shards_mod.__file__)) == shards_mod.__file__
        ray.kill(shard, no_restart=False)
        deadline = time.monotonic() + 60
        while _pid(shard) in (None, pid):
            assert time.monotonic() < deadline, "Ray did not restart the shard"
            time.sleep(0.2)
        assert ray.get(shard.__ray_call__.remote(lambda self: (self.replayed, sorted(self._held)))) == (2, ["r"])
        assert router.get_stats()["queued_trajectories"] == 1  # re-opened by the router, then answered
        assert router.append((1, 2), "h1", _reward(0.0), token)["status"] == "write"
    finally:
        manager.shutdown()


def _pid(actor):
    import ray

    try:
        return ray.get(actor.pid.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - restarting
        return None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("restart", [False, True], ids=["down", "restarting"])
def test_the_coordinator_answers_takes_and_renewals_while_a_shard_is_down(ray_cluster, tmp_path, restart,
                                                                          monkeypatch):
    """The coordinator's take reads the grouping counters (dropped groups move the band) inside the lock every
    take and report holds; with a shard down, or being restarted by Ray (calls to it wait until it is back:
    seconds), it answers from the last counters it read instead of waiting. A take held up behind it (and, when
    the actor served one call at a time, a renewal) let live collectors' units be reissued while they still
    handed them over (a group stored twice)."""
    import ray

    from rbpipe.service.ray import RayManager

    release = tmp_path / "release"
    if restart:  # Ray's restart of the shard waits for this file: the answers must come while it is down
        monkeypatch.setenv(SHARD_RESTART_ENV, str(release))
    manager = RayManager.start(shards=1, ttl_s=5.0, log_dir=str(tmp_path), prefix=f"coordwait{int(restart)}-")
    try:
        assert manager.restart_wait_s > 20  # the routers wait for restarts; the coordinator must not
        limiter = {"samples_per_insert": 1.0, "error_buffer": 8.0, "min_size_to_sample": 1}
        manager.get_registry("c", {"grpo_size": 2}, 1, {"path": str(tmp_path / "staging"), "temporary": False})
        coordinator = manager.get_coordinator("c", {"samples_per_prompt": 2, "unit_size": 1, "limiter": limiter,
                                                    "state_dir": str(tmp_path)})
        actor, shard = manager.coordinator_actor, manager.shard_actors[0]
        token = ray.get(actor.lease.remote())
        assert coordinator.join(token) == 0
        pid = ray.get(shard.pid.remote())
        ray.kill(shard, no_restart=not restart)
        time.sleep(0.5)  # past the coordinator's counters cache
        take = actor.call.remote("c", "take_many", (token, 1), {})
        renew = actor.renew.remote(token)
        # not the shard's restart (held until the test releases it) nor, down for good, the routers' wait for one
        # (restart_wait_s > 20 s): 15 s leaves a loaded machine room
        assert ray.get(renew, timeout=15) is True
        assert ray.get(take, timeout=15) == [{"prompt": 0, "samples": 1}]
        if restart:  # the restart was held until now: those answers came while the shard was down
            release.touch()
            started = time.monotonic()
            while _pid(shard) in (None, pid):
                assert time.monotonic() - started < 60, "Ray did not restart the shard"
                time.sleep(0.2)
    finally:
        release.touch()
        manager.shutdown()


@pytest.mark.timeout(180)
def test_a_waiting_take_on_ray_is_answered_when_the_learner_moves_the_band(ray_cluster, tmp_path):
    """Push, not poll, on Ray as in the local manager: a collector's ``take_many`` held back by the band waits
    in the (threaded) coordinator actor and is answered by the learner's report that moves the band.

    No timing is asserted. Each try fills the band, sends a take that may wait (0.2 s at most, the service's
    cap), then the report. The driver sends both to the actor in that order: an actor serving one call at a
    time would run the report only after the take gave up, and every try would get ``[]``. A threaded one
    answers the take with the prompt the report opened, unless the report came more than 0.2 s late, which a
    later try repeats."""
    import ray

    from rbpipe.service.ray import RayManager

    manager = RayManager.start(shards=1, ttl_s=30.0, prefix="longpoll-")
    try:
        band = {"samples_per_insert": 1.0, "error_buffer": 1.0, "min_size_to_sample": 1}
        manager.get_registry("p", {"grpo_size": 2}, 1, {"path": str(tmp_path / "staging"), "temporary": False})
        coordinator = manager.get_coordinator("p", {"samples_per_prompt": 2, "unit_size": 2, "limiter": band,
                                                    "state_dir": str(tmp_path)})
        actor = manager.coordinator_actor
        token = ray.get(actor.lease.remote())
        coordinator.join(token)
        answered = []
        for resolved in range(1, 11):
            while coordinator.take_many(token, 1):  # open prompts until the band holds
                pass
            take = actor.call.remote("p", "take_many", (token, 1, 0.2), {})
            coordinator.report_learner(consumed_groups=resolved)  # moves the band by one prompt
            answered = ray.get(take, timeout=60)
            if answered:
                break
        assert answered and len(answered) == 1 and answered[0]["samples"] == 2
    finally:
        manager.shutdown()


@pytest.mark.timeout(180)
def test_the_final_share_out_counts_drops_of_a_shard_being_restarted(ray_cluster, tmp_path):
    """The coordinator's close saves the run's final counters (``prompts.json``: a resumed run's band starts from
    its dropped groups). Its quick read gives up on a shard that Ray is restarting after 50 ms and keeps the last
    counters; the close must wait for the shard instead, or the final count misses the drops since that read."""
    import ray

    from rbpipe.grouping import SharedMCAdvantage
    from rbpipe.service.journal import load_state
    from rbpipe.service.ray import RayManager
    from tests.grouping.helpers import MINIMAL_KEYS, traj

    manager = RayManager.start(shards=1, ttl_s=5.0, log_dir=str(tmp_path), prefix="closestats-")
    grouping = None
    try:
        grouping = SharedMCAdvantage(2, prompt_key="group_id", manager=manager, name="c", shards=1,
                                     staging_dir=str(tmp_path / "staging"), required_keys=MINIMAL_KEYS,
                                     trajectory_return="sum", keep_return_bounds=(0.1, 0.9))
        limiter = {"samples_per_insert": 1.0, "error_buffer": 8.0, "min_size_to_sample": 1}
        coordinator = manager.get_coordinator("c", {"samples_per_prompt": 2, "unit_size": 1, "limiter": limiter,
                                                    "state_dir": str(tmp_path)})
        assert grouping.inv(traj(0, 0, [0.0])) is None and grouping.inv(traj(1, 0, [0.0])) is None
        assert grouping.get_stats()["dropped_groups"] == 1  # both returns 0: outside the bounds, dropped
        shard = manager.shard_actors[0]
        pid = _pid(shard)
        ray.kill(shard, no_restart=False)
        deadline = time.monotonic() + 30
        while _pid(shard) == pid:  # until the kill has taken: Ray restarts the shard (a cold start takes seconds)
            assert time.monotonic() < deadline, "Ray did not kill the shard"
            time.sleep(0.05)
        coordinator.close()
        assert load_state(tmp_path / "prompts.json")["totals"]["dropped_groups"] == 1
    finally:
        if grouping is not None:
            grouping.close()
        manager.shutdown()
