"""The package's imports run one way (no cycle, function-level imports included; the storage package checked
alone too), the rooms of the package (its folders and root modules) import only rooms in a lower layer
(docs/ARCHITECTURE.md), and grouping never imports storage (docs/STORAGE.md). ``workers/`` is scanned as
``rbpipe.workers`` (``rbpipe/workers`` links to it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rbpipe

ROOT = Path(rbpipe.__file__).parent
CHECKED = ("rbpipe.storage", "rbpipe.members", "rbpipe.system.fsutil")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every module of the package, ``rbpipe.workers`` included (``rbpipe/workers`` links to ``workers/``)."""
    found = {}
    for folder, _, files in os.walk(ROOT, followlinks=True):
        for file in files:
            if file.endswith(".py"):
                found[_module_name(Path(folder) / file)] = Path(folder) / file
    return found


def _imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Every rbpipe module ``path`` imports, at any depth of its code (a lazy import is still an edge):
    ``from pkg import sub`` counts as an import of ``pkg.sub`` when that is a module, else of ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, name, known) for name, path in known.items()}


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    stack, seen = [(start, [start])], set()
    while stack:
        node, trail = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return trail + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, trail + [nxt]))
    return None


@pytest.mark.parametrize("scope", [CHECKED, ("rbpipe",)], ids=["storage", "whole package"])
def test_no_module_is_on_an_import_cycle(scope):
    graph = _graph()
    checked = [m for m in graph if m.startswith(scope)]
    assert "rbpipe.storage.base" in checked and "rbpipe.storage.ledger" in checked
    cycles = [c for c in (_cycle_from(graph, m) for m in checked) if c]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


#: The rooms of the package, bottom up: a room imports only rooms of lower layers (never one of its own layer,
#: never one above). A room is a folder of ``rbpipe`` or a module at its root.
LAYERS = (
    ("rbpipe", "errors", "members", "rundir", "timing"),  # lazy exports; nouns and constants importing no rbpipe
    ("trajectory", "system", "rate_limit"),  # the trajectory's keys, OS plumbing, the limiter
    ("storage", "grouping", "loss", "model", "tracking"),  # persist groups, decide them, train, sample, bookkeeping
    ("sampling", "buffer", "demo", "view"),  # what is built on them: the sampler, the buffer, the demo, the viewer
    ("config",),  # every knob of a run
    ("service",),  # the shared state of a run (both engines)
    ("workers", "torchrl_compat"),  # the processes; the torchrl drop-in buffer (a service client of its own)
    ("cli",),  # the commands
)


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_module_belongs_to_a_declared_room():
    declared = {room for layer in LAYERS for room in layer}
    assert {_room(m) for m in _graph()} == declared


def test_rooms_import_only_rooms_below_them():
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    upward = sorted(f"{a} -> {d}" for a, deps in _graph().items() for d in deps
                    if _room(a) != _room(d) and layer[_room(d)] >= layer[_room(a)])
    assert not upward, "imports of a room in the same or a higher layer: " + "; ".join(upward)


def test_the_package_root_holds_at_most_ten_modules():
    """The root is for the nouns every room shares; a new module goes into the room of its job (issue 34)."""
    root = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 10, root


def test_the_graph_scans_the_workers():
    graph = _graph()
    assert {"rbpipe.workers.serve", "rbpipe.workers.launcher"} <= set(graph)
    assert "rbpipe.service.host" in graph["rbpipe.workers.serve"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert _cycle_from({"a": {"b"}, "b": {"c"}, "c": set()}, "a") is None


def test_backends_ledger_and_decoder_do_not_import_the_storage_class():
    graph = _graph()
    for part in ("arrow_backend", "zarr_backend", "backend", "ledger", "decoder", "catalog"):
        assert "rbpipe.storage.base" not in graph[f"rbpipe.storage.{part}"], part


def test_grouping_imports_nothing_from_storage():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("rbpipe.grouping"):
            assert not [d for d in deps if d.startswith("rbpipe.storage")], name
    code = ("import sys, rbpipe.grouping, rbpipe.grouping.transform\n"
            "print(sorted(m for m in sys.modules if m.startswith('rbpipe.storage')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out  # not even through another module


def test_catalogue_and_ledger_scan_import_no_torch():
    code = ("import sys, rbpipe.storage.catalog, rbpipe.storage.ledger\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_module_over_500_lines_says_why_in_its_docstring():
    """Issue 34: big rooms are split by job; one that stays big states its reason (``Size (over 500 lines): ...``)."""
    import ast

    unexplained = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 500 and "Size (over 500 lines):" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{name} ({text.count(chr(10))} lines)")
    assert not unexplained, f"modules over 500 lines without a stated reason: {unexplained}"
