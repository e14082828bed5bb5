"""The package layout: ``workers/`` installs as ``rbpipe.workers`` (never as a top-level ``workers``) through the
relative link ``rbpipe/workers -> ../workers``, which setuptools' package discovery follows, so no package is
listed by hand; and the module paths from before the package had rooms (``rbpipe.MOVED``) still import."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    import tomllib  # Python 3.11+
except ImportError:  # Python 3.10 (supported): pip vendors the same parser; never a skip
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_package_discovery_finds_every_package_folder_and_the_workers():
    from setuptools.discovery import PackageFinder

    link = ROOT / "rbpipe" / "workers"
    assert link.is_symlink() and os.readlink(link) == "../workers", "rbpipe/workers must link to ../workers"
    find = _setuptools()["packages"]["find"]  # a find table, not a hand-kept list
    found = set(PackageFinder.find(str(ROOT), include=find["include"]))
    folders = {"rbpipe" + "".join(f".{p}" for p in init.parent.relative_to(ROOT / "rbpipe").parts)
               for init in (ROOT / "rbpipe").rglob("__init__.py")}
    folders |= {"rbpipe.workers" + "".join(f".{p}" for p in init.parent.relative_to(ROOT / "workers").parts)
                for init in (ROOT / "workers").rglob("__init__.py")}
    assert found == folders and "rbpipe.workers" in found


@pytest.mark.parametrize("old", ["rbpipe.schema", "rbpipe.query", "rbpipe.procs", "rbpipe.rayengine",
                                 "rbpipe.rayengine.session"])
def test_a_moved_module_path_imports_the_module_at_its_new_path(old):
    import rbpipe

    new = importlib.import_module(rbpipe._MovedModules.new_name(old) or "")
    assert importlib.import_module(old) is new and new.__spec__.name == new.__name__ != old


def test_the_readme_and_examples_import_paths_still_import():
    """``from X import name`` / ``import X`` lines of README.md and examples/: the contract of issue 34."""
    import re

    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "examples").glob("*.py"))
    named = set(re.findall(r"\b(?:from|import) (rbpipe(?:\.\w+)*)", text))
    named |= set(re.findall(r"`(rbpipe(?:\.\w+)+)\.\w+\(", text))  # `rbpipe.query.query(...)` in prose
    assert {"rbpipe.schema", "rbpipe.query", "rbpipe.config"} <= named
    for name in named:
        importlib.import_module(name)


def test_workers_import_as_rbpipe_workers_only(tmp_path):
    code = ("import importlib.util as u, rbpipe.workers.learner, rbpipe.workers.serve, rbpipe.workers.launcher\n"
            "print(rbpipe.workers.learner.__file__); print(u.find_spec('workers'))")
    for cwd in (ROOT, tmp_path):  # the repository root (rbpipe/ found in the cwd first) and elsewhere
        # -P: without the cwd on sys.path, `workers` must not be importable: it is installed as rbpipe.workers
        out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=cwd,
                             check=True, env={**os.environ, "PYTHONPATH": ""}).stdout.split("\n")
        assert Path(out[0]).parts[-2:] == ("workers", "learner.py") and out[1] == "None", out
    # and from the repository root without -P, where the folder is on sys.path, `import workers` is refused
    err = subprocess.run([sys.executable, "-c", "import workers.learner"], capture_output=True, text=True,
                         cwd=ROOT).stderr
    assert "import rbpipe.workers.<module>" in err, err


def test_rbpipe_connect_stays_the_function_once_every_module_is_imported():
    """``rbpipe.connect(RUN_DIR)`` is the documented entry point: no submodule may shadow it once imported."""
    import importlib

    import rbpipe

    for module in ("rbpipe.service.clients", "rbpipe.workers.collector", "rbpipe.workers.learner",
                   "rbpipe.workers.serve"):
        importlib.import_module(module)
    assert callable(rbpipe.connect) and rbpipe.connect.__module__ == "rbpipe.service.clients"
    assert callable(rbpipe.connect_learner)
