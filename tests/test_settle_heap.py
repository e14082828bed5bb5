"""A worker's start-up heap stays out of later garbage collections (run in a child: it changes the process)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from rbpipe.system.procs import GC_YOUNG_THRESHOLD, settle_heap

model = [["layer", i] for i in range(1000)]  # what a worker builds at start-up (lists: always tracked)
settle_heap()
tracked = {id(o) for o in gc.get_objects()}
assert not any(id(layer) in tracked for layer in model), "start-up objects are still walked by collections"
assert gc.get_freeze_count() >= 1000
assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
later = [["step", 1]]  # a list is always tracked (a dict of plain values may not be)
assert any(o is later for o in gc.get_objects()), "objects made after start-up must still be collectable"
print("settled")
"""


def test_settle_heap_freezes_what_start_up_built_and_keeps_later_objects_collectable():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "settled"
