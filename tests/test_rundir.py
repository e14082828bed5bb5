"""Every run-directory name is spelled once, in ``rbpipe/rundir.py`` (issue 34): no other module writes one as a
string literal, so the writer and the readers of a file cannot drift apart."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import rbpipe
from rbpipe import rundir

PACKAGE = Path(rbpipe.__file__).parent
#: the same spelling for something else: a Hugging Face model directory's config.json
OTHER_FILES = {("demo/policy.py", "config.json")}
#: words too common to look for (an argparse dest, a JSON key): the names are in rundir all the same
COMMON = {"store", "staging", "memory", "logs"}


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and "{" not in v}


def test_no_module_but_rundir_spells_a_run_directory_name():
    names = set(_names().values())
    assert {"checkpoint.pt", "metrics.jsonl", "prompts.json", "endpoint.json", "summary.json"} <= names
    found = []
    for folder, _, files in os.walk(PACKAGE, followlinks=True):  # rbpipe/workers links to workers/
        for file in files:
            path = Path(folder) / file
            if not file.endswith(".py") or path == PACKAGE / "rundir.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names - COMMON \
                        and (str(path.relative_to(PACKAGE)), node.value) not in OTHER_FILES:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not found, "run-directory names spelled outside rbpipe/rundir.py: " + "; ".join(found)


def test_the_resume_order_names_run_directory_states():
    states = [state for state, _, _ in rundir.RESUME_ORDER]
    assert states.index("commit log") < states.index("staging") < states.index("prompts journal")
    assert states[-1] == "checkpoint"
