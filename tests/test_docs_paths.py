"""Every code path and module the design documents name exists (docs/ARCHITECTURE.md is a map of the tree)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("ARCHITECTURE.md", "DESIGN.md", "STORAGE.md", "RAY.md")
#: where a short name is looked up: the documents say `ledger.py` or `storage/decoder.py` inside rbpipe/storage
BASES = (ROOT, ROOT / "rbpipe", ROOT / "rbpipe" / "storage", ROOT / "docs")
CODE = re.compile(r"`([^`\s]+)`")


def _named(doc: str) -> tuple[list[str], list[str]]:
    paths, modules = [], []
    for token in CODE.findall((ROOT / "docs" / doc).read_text()):
        token = token.split("::")[0]
        if token.endswith((".py", ".md", ".toml")) or token.startswith(("rbpipe/", "workers/")):
            paths.append(token)
        elif re.fullmatch(r"rbpipe(\.\w+)+", token):
            modules.append(token)
    return paths, modules


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_document_names_exists(doc):
    paths, _ = _named(doc)
    missing = [p for p in paths if not any((base / p).exists() for base in BASES)]
    assert not missing, f"docs/{doc} names paths that do not exist: {missing}"


def test_the_architecture_names_the_layout():
    paths, modules = _named("ARCHITECTURE.md")
    assert {"workers/collector.py", "workers/learner.py", "rbpipe/demo/policy.py", "rbpipe/demo/task.py"} <= set(paths)
    assert "rbpipe.workers.collector" in modules


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_a_document_names_imports(doc):
    _, names = _named(doc)
    missing = []
    for name in names:  # `rbpipe.workers.serve` is a module, `rbpipe.grouping.SharedMCAdvantage` an attribute
        parts = name.split(".")
        depth = max(n for n in range(1, len(parts) + 1) if _is_module(".".join(parts[:n])))
        obj = importlib.import_module(".".join(parts[:depth]))
        for attr in parts[depth:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    assert not missing, f"docs/{doc} names modules or objects that do not exist: {missing}"


def _is_module(name: str) -> bool:
    """``rbpipe.tracking.background.BackgroundJobs``: ``find_spec`` raises (not None) below a module that is no
    package."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
