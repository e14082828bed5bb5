"""The store protocol: what the buffer and the sampler rely on is declared by the store, never guessed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torchrl.data import LazyTensorStorage

from rbpipe.storage import ArrowStorage, ZarrStorage
from rbpipe.storage.protocol import GroupStore, is_group_store

ROOT = Path(__file__).resolve().parents[2]
#: the modules that talk to a store on the write and sample paths
CALLERS = ("rbpipe/buffer.py", "rbpipe/storage/writer.py", "rbpipe/sampling/group_sampler.py")


@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_rbpipe_stores_declare_every_capability_of_the_protocol(tmp_path, cls):
    store = cls(tmp_path / "s")
    assert is_group_store(store)
    flags = {name for name, kind in GroupStore.__annotations__.items() if kind == "bool"}
    assert flags == {"accepts_jagged", "idempotent_commits", "holds_reads"}
    assert all(getattr(type(store), name) is True for name in flags)  # declared by the class, not per instance
    store.close()


def test_a_torchrl_storage_is_not_a_group_store():
    assert not is_group_store(LazyTensorStorage(10))


@pytest.mark.parametrize("path", CALLERS)
def test_callers_ask_the_protocol_not_hasattr_or_signatures(path):
    """A capability is a flag of the protocol (``is_group_store`` + the flag), never ``hasattr(storage, ...)``
    or ``inspect.signature`` of a store's method."""
    tree = ast.parse((ROOT / path).read_text())
    sniffing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
            if isinstance(node.args[0], ast.Name) and "stor" in node.args[0].id:
                sniffing.append(ast.unparse(node))
        if isinstance(node, ast.Attribute) and node.attr == "signature":
            sniffing.append(ast.unparse(node))
    assert not sniffing, f"{path}: {sniffing}"


def test_opening_a_store_creates_no_named_semaphore(tmp_path):
    """A killed process cannot unlink a named semaphore: a store (opened by every worker) must hold none, or each
    SIGKILLed worker and Ray actor leaves ``/dev/shm/sem.mp-*`` files behind (torchrl's storage counters are
    ``multiprocessing.Value``s unless the storage is built ``compilable``)."""
    import subprocess
    import sys

    # the semaphores this process maps (sem_open maps /dev/shm/sem.*): other processes of the machine (tests
    # running beside this one) create and remove theirs in /dev/shm meanwhile
    code = ("sems = lambda: {m.split('/dev/shm/')[1].strip() for m in open('/proc/self/maps')"
            " if '/dev/shm/sem.' in m}\n"
            "before = sems()\n"
            "from rbpipe.storage import ArrowStorage, ZarrStorage\n"
            f"stores = [ArrowStorage({str(tmp_path / 'a')!r}), ZarrStorage({str(tmp_path / 'z')!r})]\n"
            "[len(s) for s in stores]\n"
            "print(sorted(sems() - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
