"""Small file-system idioms written once: replace a file atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, data: str | bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader (or a crash) sees the old file or the new one, never half:
    write a temporary file beside it, then rename it over ``path``. ``mode``: permissions of the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(tmp, flags, 0o644 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> None:
    """:func:`atomic_write` of ``obj`` as JSON."""
    atomic_write(path, json.dumps(obj, **dumps_kwargs))
