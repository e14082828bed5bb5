"""A coordinator whose process died, restarted on the same state (``Coordinator(restarted=True)``, what the Ray
engine's coordinator actor does when Ray restarts it): the live service goes on where it was, where a resumed
service (a new session) would hand its collectors' units out again."""

from __future__ import annotations

from rbpipe.grouping.leases import LEASES
from rbpipe.rundir import PROMPTS
from rbpipe.service.coordinator import Coordinator
from rbpipe.service.journal import journal_path_of

BAND = {"samples_per_insert": 1.0, "error_buffer": 3.0, "min_size_to_sample": 1}


def _died(*leases: str) -> None:
    """The coordinator's process is gone, and its lease table with it (here: the tokens are forgotten)."""
    for lease in leases:
        LEASES.release(lease)


def _live_state(coord: Coordinator) -> tuple:
    status = coord.status()
    return (status["produced_total"], status["produced"], status["rejected_total"], status["next_prompt"],
            status["collectors"], status["learner"], status["band"], status["units"], dict(coord._units))


def test_a_restarted_coordinator_goes_on_with_the_live_service(tmp_path):
    coord = Coordinator(4, 2, BAND, str(tmp_path), restartable=True)
    a, b = LEASES.grant(), LEASES.grant()
    assert (coord.join(a), coord.join(b)) == (0, 1)
    assert coord.take(a) == coord.take(b) == {"prompt": 0, "samples": 2}  # prompt 0: a and b
    coord.appended(0, a, 2)  # a handed its unit over
    coord.count(produced=2, reasons={"reward_error": 0})
    assert coord.take(a) == {"prompt": 1, "samples": 2}  # a now holds half of prompt 1
    coord.count(produced=1, rejected=1, reasons={"reward_error": 1})
    coord.report_learner(step=3, consumed_groups=0, phase="training")
    coord.set_endpoint({"address": "127.0.0.1:1"})
    before = _live_state(coord)
    _died(a, b)  # no close: the process died

    again = Coordinator(4, 2, BAND, str(tmp_path), restarted=True, restartable=True)
    assert _live_state(again) == before  # ids, leases (taken in), counters, the learner, the band, the units
    assert again.endpoint() == {"address": "127.0.0.1:1"}
    c = LEASES.grant()
    assert again.join(c) == 2  # never an id used before in this service
    # what a and b hold stays theirs: c gets prompt 1's other half and then a new prompt, not prompt 0 again
    assert [again.take(c), again.take(c)] == [{"prompt": 1, "samples": 2}, {"prompt": 2, "samples": 2}]
    again.appended(0, b, 2)  # b hands over the unit it took before the restart: prompt 0 is done
    assert (0, b) not in again._units
    again.close()


def test_a_take_or_count_run_again_after_a_restart_acts_once(tmp_path):
    """Ray resubmits a call that the coordinator's death cut off. When the dead coordinator had journaled it but
    the answer never reached the collector, the resubmitted call (same lease, same number) must not act twice.
    A take must give the same units, not a second share: the first ones would stay with that collector, never
    generated, and their prompts never completed while it lives. A count must not count its trajectories twice
    (the summary's conservation would no longer balance)."""
    coord = Coordinator(4, 2, BAND, str(tmp_path), restartable=True)
    a, b = LEASES.grant(), LEASES.grant()
    coord.join(a), coord.join(b)
    first = coord.take_many(a, 2, 0.0, 1)  # journaled; the answer is lost with the process
    assert first == [{"prompt": 0, "samples": 2}, {"prompt": 1, "samples": 2}]
    coord.count(3, 1, 0, 0, {"reward_error": 1}, a, 2)  # journaled too, its answer lost
    _died(a, b)

    again = Coordinator(4, 2, BAND, str(tmp_path), restarted=True, restartable=True)
    held = dict(again._units)
    assert again.join(a) == 0  # a join run again keeps the collector's id
    assert again.take_many(a, 2, 0.0, 1) == first  # the resubmitted call
    assert dict(again._units) == held and again.status()["next_prompt"] == 2  # nothing more was given
    assert again.take_many(a, 1, 0.0, 2) == [{"prompt": 2, "samples": 2}]  # its next ask gets new work
    assert again.take_many(b, 2, 0.0, 1) == first  # b's own first ask: the other halves of prompts 0 and 1
    again.count(3, 1, 0, 0, {"reward_error": 1}, a, 2)  # the resubmitted count
    status = again.status()
    assert (status["produced"], status["rejected"], status["rejected_reasons"]) == (3, 1, {"reward_error": 1})
    again.count(2, 0, 0, 0, None, a, 4)  # a's next count is counted
    again.count(2, 0, 0, 0, None, b, 2)  # b numbers its own calls
    assert again.status()["produced"] == 7
    again.close()


def test_a_resumed_service_hands_the_last_sessions_units_out_again(tmp_path):
    """The contrast: a new session (``rbpipe serve --resume``) does not know the last session's collectors."""
    coord = Coordinator(4, 2, BAND, str(tmp_path))
    a = LEASES.grant()
    coord.join(a)
    assert coord.take(a) == {"prompt": 0, "samples": 2}
    coord.count(produced=5)
    _died(a)

    resumed = Coordinator(4, 2, BAND, str(tmp_path))
    status = resumed.status()
    assert status["produced"] == 0 and status["produced_total"] == 5 and status["collectors"] == {}
    b = LEASES.grant()
    resumed.join(b)
    assert resumed.take(b) == {"prompt": 0, "samples": 2}  # a's unit, back in the pool
    resumed.close()


def _journal_lines(state_dir) -> int:
    path = journal_path_of(state_dir / PROMPTS)
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_only_a_restartable_coordinator_journals_every_call(tmp_path):
    """A coordinator no engine restarts (the local manager's) writes ``prompts.json`` where a resume needs it: a
    new prompt, a hand-over and its count. Takes inside an open prompt, learner reports and the endpoint add
    nothing; a restartable one (the Ray actor's) records each of them."""
    lines = {}
    for restartable in (False, True):
        state_dir = tmp_path / str(restartable)
        state_dir.mkdir()
        coord = Coordinator(4, 2, BAND, str(state_dir), restartable=restartable)
        a, b = LEASES.grant(), LEASES.grant()
        coord.join(a), coord.join(b)
        coord.take(a)  # prompt 0 opens: saved either way
        start = _journal_lines(state_dir)
        coord.take(b)  # the other half of prompt 0
        coord.report_learner(step=1)
        coord.set_endpoint({"address": "127.0.0.1:1"})
        lines[restartable] = _journal_lines(state_dir) - start
        coord.appended(0, a, 2)  # a hand-over and its count: saved either way
        coord.count(produced=2)
        assert _journal_lines(state_dir) - start == lines[restartable] + 2
        coord.close()
        _died(a, b)
    assert lines == {False: 0, True: 3}
