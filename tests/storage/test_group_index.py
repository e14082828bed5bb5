"""The incremental row index equals a recomputation from scratch after any appends and evictions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rbpipe.storage.group_index import GroupIndex


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 9)),
                              st.tuples(st.just("evict"), st.integers(0, 6))), max_size=300))
def test_index_matches_naive(ops):
    index, live, seq = GroupIndex(), [], 0  # live: (seq, n, block, local)
    for op, arg in ops:
        if op == "add":
            index.append(seq, arg, seq % 3, seq % 5)
            live.append((seq, arg, seq % 3, seq % 5))
            seq += 1
        elif live:
            upto = live[min(arg, len(live) - 1)][0]
            index.evict_upto(upto)
            live = [g for g in live if g[0] > upto]
        n = np.asarray([g[1] for g in live], np.int64)
        stops = np.cumsum(n)
        seqs, starts, stops_i, blocks, local = index.arrays()
        assert seqs.tolist() == [g[0] for g in live]
        assert stops_i.tolist() == stops.tolist() and starts.tolist() == (stops - n).tolist()
        assert blocks.tolist() == [g[2] for g in live] and local.tolist() == [g[3] for g in live]
        assert index.rows == int(n.sum()) and len(index) == len(live)
        for g, start in zip(live, (stops - n).tolist(), strict=True):
            assert index.start_of(g[0]) == start
        assert index.start_of(seq + 1) is None


def test_index_grows_past_its_initial_capacity():
    index = GroupIndex()
    for seq in range(5000):
        index.append(seq, 2, 0, 0)
    index.evict_upto(2499)
    seqs, starts, stops, _, _ = index.arrays()
    assert seqs[0] == 2500 and len(seqs) == 2500 and starts[0] == 0 and stops[-1] == 5000 == index.rows
    assert index.start_of(4999) == 4998 and index.start_of(2499) is None
