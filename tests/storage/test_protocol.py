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
