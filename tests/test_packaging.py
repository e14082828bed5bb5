"""The package layout: ``workers/`` installs as ``rbpipe.workers`` (never as a top-level ``workers``), and
pyproject.toml's explicit package list names every package folder (a missing one would be left out of the
wheel while the editable install, which maps ``rbpipe`` as a whole, still imports it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import tomllib  # Python 3.11+
except ImportError:  # Python 3.10 (supported): pip vendors the same parser; never a skip
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_names_every_package_folder():
    conf = _setuptools()
    folders = {"rbpipe" + "".join(f".{p}" for p in init.parent.relative_to(ROOT / "rbpipe").parts)
               for init in (ROOT / "rbpipe").rglob("__init__.py")}
    folders |= {"rbpipe.workers" + "".join(f".{p}" for p in init.parent.relative_to(ROOT / "workers").parts)
                for init in (ROOT / "workers").rglob("__init__.py")}
    assert set(conf["packages"]) == folders
    assert conf["package-dir"] == {"rbpipe.workers": "workers"}
    assert not (ROOT / "rbpipe" / "workers").exists(), "rbpipe/workers/ would hide the mapped workers/ folder"


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

    for module in ("rbpipe.clients", "rbpipe.workers.collector", "rbpipe.workers.learner", "rbpipe.workers.serve"):
        importlib.import_module(module)
    assert callable(rbpipe.connect) and rbpipe.connect.__module__ == "rbpipe.clients"
    assert callable(rbpipe.connect_learner)
