"""Linter and type checker (issue 20): ``ruff check`` and ``mypy``, configured in pyproject.toml, find nothing.

Both run as CI runs them, from the repository root with this interpreter (the ``test`` extra installs them).
Neither leaves a cache in the repository: ruff runs without one, mypy's goes to a temporary directory (a cold
cache: mypy then takes a minute or more on a small machine, hence the long timeouts).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_ruff_finds_nothing():
    proc = _run("ruff", "check", "--no-cache", ".", timeout=280)
    assert proc.returncode == 0, f"ruff check exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.timeout(900)
def test_mypy_finds_nothing(tmp_path):
    proc = _run("mypy", "--cache-dir", str(tmp_path / "mypy_cache"), timeout=880)  # files: pyproject.toml
    assert proc.returncode == 0, f"mypy exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
