"""The page: one HTML template with its script and style (package data under ``static/``), filled in for the
live server (data fetched from ``/api/...``) or as one self-contained file (data and plot library inline).

Why one template for both: the ``--html`` file must be "the same page", so the difference is only where the
script gets its data from (``window.RBPIPE_DATA`` present or not), never a second layout.
"""

from __future__ import annotations

import html
import json
import os
import re
from importlib import resources
from typing import Any


def asset(name: str) -> str:
    """A file of ``rbpipe/view/static/`` (installed as package data in editable and normal installs)."""
    return resources.files("rbpipe.view").joinpath("static").joinpath(name).read_text(encoding="utf-8")


def plotly_js() -> str:
    """plotly.js as shipped inside the ``plotly`` package: the page never loads anything from the network."""
    from plotly.offline import get_plotlyjs

    return str(get_plotlyjs())


def _inline_json(doc: Any) -> str:
    """JSON that can sit inside ``<script>``: no ``</script>``, no HTML comment, no JS line separators."""
    text = json.dumps(doc, allow_nan=False, separators=(",", ":"), default=str)
    for bad, good in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                      ("\u2029", "\\u2029")):
        text = text.replace(bad, good)
    return text


def render_page(store: str | os.PathLike, static: dict[str, Any] | None) -> str:
    """The page for ``store``: live (``static`` None: the script polls the server) or with ``static`` data
    embedded and plotly.js inline (a file that needs no server and no network)."""
    name = html.escape(str(store))
    if static is None:
        plot = '<script src="plotly.min.js"></script>'
        data = ""
    else:
        plot = "<script>" + plotly_js() + "</script>"
        data = f"<script>window.RBPIPE_DATA = {_inline_json(static)};</script>"
    parts = {"{{STORE}}": name, "{{CSS}}": asset("view.css"), "{{PLOTLY}}": plot, "{{DATA}}": data,
             "{{JS}}": asset("view.js")}
    # one pass: text inserted (a prompt may read "{{JS}}") is never searched again
    return re.sub(r"\{\{[A-Z]+\}\}", lambda m: parts.get(m.group(0), m.group(0)), asset("page.html"))
