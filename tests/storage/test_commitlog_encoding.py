"""Commit-log lines: the fast JSON path must read back exactly what the stdlib path would (for the values
records hold: 64-bit integers, floats including NaN/inf, strings, None, nested lists and dicts)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rbpipe.storage.commitlog import decode, encode

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(record=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=8))
def test_every_record_reads_back_as_the_stdlib_json_round_trip(record):
    line = encode(record)
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    # NaN != NaN, so compare canonical stdlib renderings (which also turn tuples into lists)
    expected = json.dumps(json.loads(json.dumps(record)), sort_keys=True)
    assert json.dumps(decode(line[:-1]), sort_keys=True) == expected


def test_a_corrupted_line_reads_as_torn():
    line = encode({"seq": 3, "values": [0.5, float("nan"), None]})[:-1]
    assert decode(line) is not None
    assert decode(line[:-5]) is None  # cut short by a kill mid-write
    assert decode(line.replace(b"0.5", b"0.6")) is None  # checksum mismatch
