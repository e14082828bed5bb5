"""``rbpipe view PATH --html OUT.html``: the page as one file, data and plot library inside, for sharing.

The file needs no server and no network: the groups (newest first, those matching ``--where``, at most
``--limit``), each one's members and the plot's numbers are embedded as JSON, and plotly.js is inlined from
the installed package. Filters cannot run without the server's DuckDB, so the condition is applied when the
file is written and shown on the page.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rbpipe.errors import ConfigError
from rbpipe.system.fsutil import atomic_write
from rbpipe.view.page import render_page
from rbpipe.view.source import StoreView

#: groups a file holds by default: a file of bounded size (figures: docs/DESIGN.md, Figures behind code choices)
DEFAULT_LIMIT = 10_000


def check_output(out: Path, store: Path) -> None:
    """Refuse, before anything is read or written, an output the user cannot have meant."""
    if out.is_dir():
        raise ConfigError(f"--html {out} is a directory: pass a file name, e.g. {out / 'view.html'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--html {out}: the folder {out.parent} does not exist; create it or pass another path")
    try:
        out.resolve().relative_to(store.resolve())
    except ValueError:
        return
    raise ConfigError(f"--html {out} is inside the store {store}: the viewer never writes into a store; "
                      "pass a path outside it")


def snapshot(view: StoreView, where: str | None, limit: int) -> dict[str, Any]:
    """Everything the page shows, for ``limit`` groups (0: all) matching ``where`` (raises on a bad filter)."""
    page = view.page(where, 0, limit if limit > 0 else 1 << 62)
    seqs = [r["seq"] for r in page["rows"]]
    docs = view.groups(seqs)
    return {"state": view.state(), "page": page, "groups": {str(s): docs[s] for s in seqs if s in docs},
            "plot": view.plot(where), "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def write_html(view: StoreView, out: str | os.PathLike, where: str | None = None,
               limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """Write the self-contained page to ``out`` (whole or not at all: written aside, then renamed); returns
    ``{"path", "groups", "total", "bytes"}``."""
    out = Path(out)
    check_output(out, view.store)
    data = snapshot(view, where, limit)
    text = render_page(view.store, static=data).encode()
    atomic_write(out, text, fsync=False)
    return {"path": str(out), "groups": len(data["page"]["rows"]), "total": data["state"]["groups"],
            "bytes": len(text)}
