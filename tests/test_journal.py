"""``StateJournal``: the latest saved state is what any reader loads, after a kill, a torn append or a
compaction; a save costs an append, not a rewrite of the snapshot."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rbpipe.grouping.leases import LEASES
from rbpipe.service.coordinator import PROMPTS, Coordinator
from rbpipe.service.journal import StateJournal, load_state

STATES = st.lists(st.dictionaries(st.sampled_from(["next_prompt", "todo", "totals"]),
                                  st.integers(0, 10**6) | st.dictionaries(st.text("0123456789", min_size=1),
                                                                          st.integers(0, 8), max_size=6)),
                  min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(states=STATES, compact_bytes=st.integers(1, 2000), torn=st.binary(max_size=30).filter(lambda b: b"\n" not in b))
def test_the_last_saved_state_is_loaded_after_a_kill_a_torn_append_and_compactions(tmp_path_factory, states,
                                                                                   compact_bytes, torn):
    path = tmp_path_factory.mktemp("j") / "state.json"
    journal = StateJournal(path, compact_bytes=compact_bytes)
    for state in states:
        journal.save(state)
        assert load_state(path) == state  # readable at every moment, by another reader
    with open(journal.journal_path, "ab") as f:  # killed in the middle of the next append
        f.write(torn)
    assert load_state(path) == states[-1]
    # the next session (the killed one never closed): continues after the torn line, then closes
    again = StateJournal(path, compact_bytes=compact_bytes)
    assert again.load() == states[-1]
    again.save({"after": 1})
    assert load_state(path) == {"after": 1}
    again.close()
    assert load_state(path) == {"after": 1} and not again.journal_path.exists()
    assert json.loads(path.read_text())["after"] == 1  # the snapshot alone holds it after a clean close


def test_a_save_appends_a_line_and_leaves_the_snapshot_alone_until_compaction(tmp_path):
    path = tmp_path / "state.json"
    journal = StateJournal(path, compact_bytes=200)
    journal.save({"n": 0})
    assert not path.exists() and journal.journal_path.read_text().count("\n") == 1
    for n in range(1, 20):
        journal.save({"n": n})
    assert json.loads(path.read_text())["n"] > 0  # compacted once the journal passed 200 bytes
    assert journal.journal_path.stat().st_size <= 200
    assert load_state(path) == {"n": 19}


def test_a_coordinator_killed_without_closing_resumes_from_its_last_hand_over(tmp_path):
    """The share-out is saved at every hand-over without rewriting prompts.json; a service that resumes after
    a kill (no close) still continues from the last one."""
    band = {"samples_per_insert": 1.0, "error_buffer": 8.0, "min_size_to_sample": 1}
    coord = Coordinator(4, 2, band, str(tmp_path))
    a, b = LEASES.grant(), LEASES.grant()
    coord.join(a), coord.join(b)
    assert coord.take_many(a, 2) == [{"prompt": 0, "samples": 2}, {"prompt": 1, "samples": 2}]
    snapshot = (tmp_path / PROMPTS).stat() if (tmp_path / PROMPTS).exists() else None
    coord.appended_many(a, {0: 2, 1: 2})
    after = (tmp_path / PROMPTS).stat() if (tmp_path / PROMPTS).exists() else None
    assert after is None or (after.st_ino, after.st_mtime_ns) == (snapshot.st_ino, snapshot.st_mtime_ns)
    assert load_state(tmp_path / PROMPTS)["todo"] == {"0": 2, "1": 2}  # b's halves, still owed
    LEASES.release(a), LEASES.release(b)
    # killed here: no close. The resumed service owes exactly b's halves, then new prompts
    resumed = Coordinator(4, 2, band, str(tmp_path))
    c = LEASES.grant()
    resumed.join(c)
    assert resumed.take_many(c, 3) == [{"prompt": 0, "samples": 2}, {"prompt": 1, "samples": 2},
                                       {"prompt": 2, "samples": 2}]
    resumed.close()
    assert json.loads((tmp_path / PROMPTS).read_text())["next_prompt"] == 3
    coord._limiter.unlink()
