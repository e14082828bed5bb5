"""The decoder: a read's columns -> one TensorDict, in the layout the store was opened with (docs/STORAGE.md).

Input (what ``GroupStorage`` gathers from a backend): per column of the schema, a fixed column as one
``[rows, *shape]`` array; a ragged column as a list of ``(flat values, shapes)`` parts in row order (views
of the mapped files where possible); a text column as UTF-8 bytes parts. Output, per ``ragged_layout``:

* ``"nested"`` (the default where every ragged field is 1-D and real): each ragged key one jagged
  ``torch.nested`` tensor (one values tensor plus offsets; fields of equal row lengths share the offsets);
* ``"padded"``: dense, zero-padded to the longest row, each ragged key's lengths under ``("lengths", *key)``;
* ``"rows"``: a ``LazyStackedTensorDict`` of one TensorDict per row (torchrl's LLM convention).

TensorDicts are assembled without validation: shapes and dtypes come from the store's schema, and
``TensorDict(...)`` checks every leaf (in the rows layout, ``unbind`` plus a checked ``set`` per row dominated
sampling; figures: docs/DESIGN.md, Figures behind code choices). Nothing here touches a file or the commit log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rbpipe.errors import SchemaError, StoreError
from rbpipe.members import jagged_tensor
from rbpipe.storage.columns import ColumnSet, decode_texts, from_storage_np, row_elements
from rbpipe.storage.gather import pad_ragged

RAGGED_LAYOUTS = ("rows", "padded", "nested")


def check_layout(layout: str | None) -> None:
    if layout is not None and layout not in RAGGED_LAYOUTS:
        raise StoreError(f"ragged_layout must be one of {', '.join(map(repr, RAGGED_LAYOUTS))}, got {layout!r}")


def choose_layout(asked: str | None, schema: ColumnSet | None) -> str:
    """The layout reads use: as asked, else ``"nested"`` when every ragged field is 1-D and real (the one
    that samples at memmap speed: one values tensor and offsets per field), else ``"rows"``."""
    if asked is not None:
        return asked
    if schema is None:
        return "nested"
    return "nested" if all(c.ndim == 1 and not c.complex for c in schema.columns if c.ragged) else "rows"


def to_tensordict(schema: ColumnSet, layout: str, data: dict[Any, Any], m: int) -> TensorDictBase:
    """The ``m`` rows whose columns are ``data`` as a TensorDict of batch size ``[m]`` (see the module doc)."""
    cols = schema.columns
    fixed = {c.key: from_storage_np(data[c.key], c.dtype) for c in cols if not c.ragged}
    texts = {c.key: decode_texts(data[c.key]) for c in cols if c.text}
    if layout == "padded":
        for c in cols:
            if c.ragged and not c.text:
                lengths_key = ("lengths", *c.key)
                fixed[c.key], fixed[lengths_key] = _pad(data[c.key], c, m)
    elif layout == "nested":
        offsets: dict[bytes, torch.Tensor] = {}  # fields with equal row lengths share one ragged dim
        for c in cols:
            if c.ragged and not c.text:
                fixed[c.key] = _jagged(data[c.key], c, m, offsets)
    if not schema.has_ragged or layout != "rows" or m == 0:
        for key, values in texts.items():  # string columns: one str per row
            fixed[key] = NonTensorStack.from_list(values) if m else NonTensorStack(batch_size=[0])
        return _dense_td(_nest(fixed), torch.Size([m]))
    per_row: dict[Any, Sequence[Any]] = {key: t.unbind(0) for key, t in fixed.items()}
    for key, values in texts.items():
        per_row[key] = [NonTensorData(v, batch_size=_NO_BATCH) for v in values]
    for c in cols:
        if c.ragged and not c.text:
            per_row[c.key] = _ragged_rows(data[c.key], c)
    return LazyStackedTensorDict(*_row_tensordicts(_nest(per_row), m), stack_dim=0)


def concat_parts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged parts -> one (flat values, shapes)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([v for v, _ in parts]), np.concatenate([s for _, s in parts])


def _pad(parts: list[tuple[np.ndarray, np.ndarray]], col, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged parts -> (``[m, *longest]`` tensor right-padded with zeros, first-dim lengths ``[m]``)."""
    trail = (2,) if col.complex else ()
    if col.ndim == 1 and len(parts) == 1:  # one part (e.g. whole groups): rows padded in parallel
        values, shapes = parts[0]
        out = pad_ragged(values, shapes[:, 0], trail, col.np_dtype)
        if out is not None:
            return from_storage_np(out, col.dtype), torch.from_numpy(shapes[:, 0].copy())
    all_shapes = np.concatenate([s for _, s in parts]) if parts else np.zeros((0, col.ndim), np.int64)
    top = tuple(int(x) for x in all_shapes.max(0)) if m else (0,) * col.ndim
    out = np.zeros((m, *top, *trail), col.np_dtype)
    i = 0
    for values, shapes in parts:  # a loop of slice copies: faster than one flat fancy-index scatter
        elems = values.reshape(-1, *trail)
        pos = 0
        for shape, k in zip(shapes.tolist(), row_elements(shapes).tolist(), strict=True):
            if col.ndim == 1:
                out[i, :k] = elems[pos:pos + k]
            else:
                where: tuple[int | slice, ...] = (i, *(slice(0, s) for s in shape))
                out[where] = elems[pos:pos + k].reshape(*shape, *trail)
            pos += k
            i += 1
    lengths = torch.from_numpy(all_shapes[:, 0].copy()) if col.ndim else torch.ones(m, dtype=torch.int64)
    return from_storage_np(out, col.dtype), lengths


def _ragged_rows(parts: list[tuple[np.ndarray, np.ndarray]], col) -> list[torch.Tensor]:
    """Ragged parts -> one tensor per row (views of one tensor per part)."""
    trail = (2,) if col.complex else ()
    out: list[torch.Tensor] = []
    for values, shapes in parts:
        flat = from_storage_np(values.reshape(-1, *trail), col.dtype)
        pieces = flat.split(row_elements(shapes).tolist())
        out += pieces if col.ndim == 1 else [t.view(shape) for t, shape in zip(pieces, shapes.tolist(), strict=True)]
    return out


_NO_BATCH = torch.Size([])


def _row_tensordicts(tree: dict, m: int) -> list[TensorDict]:
    """``{name: per-row sequence | subtree}`` -> ``m`` row TensorDicts (``batch_size=[]``), nested like
    ``tree``; every leaf is trusted (shapes and dtypes come from the store's schema)."""
    names, columns = [], []
    for name, child in tree.items():  # column-wise, bottom-up: the per-row work is one zip and one call
        names.append(name)
        columns.append(_row_tensordicts(child, m) if isinstance(child, dict) else child)
    new = TensorDict._new_unsafe
    return [new(dict(zip(names, row, strict=True)), _NO_BATCH, nested=False) for row in zip(*columns, strict=True)]


def _jagged(parts: list[tuple[np.ndarray, np.ndarray]], col, m: int,
            offsets_by_lengths: dict[bytes, torch.Tensor]) -> torch.Tensor:
    """Ragged parts -> one jagged ``torch.nested`` tensor ``[m, j]`` (one values tensor plus offsets).

    Fields whose rows have equal lengths (tokens and their log-probs) get the very same offsets tensor, so
    they share one ragged dimension: ``a * b`` works across them, and the second NJT is cheaper to build."""
    if col.ndim != 1 or col.complex:
        raise SchemaError(f"ragged_layout='nested' holds 1-D real ragged fields only; {'.'.join(col.key)!r} is "
                          f"{col.ndim}-D {col.dtype}: open the store with ragged_layout='padded' or 'rows'")
    if m == 0:
        return torch.zeros(0, 0, dtype=getattr(torch, col.dtype))
    flat, shapes = concat_parts(parts)
    values = from_storage_np(flat.reshape(-1), col.dtype)
    lengths = np.ascontiguousarray(shapes[:, 0])
    offsets = offsets_by_lengths.get(lengths.tobytes())
    if offsets is None:
        cum = np.empty(m + 1, np.int64)
        cum[0] = 0
        np.cumsum(lengths, out=cum[1:])
        offsets = offsets_by_lengths[lengths.tobytes()] = torch.from_numpy(cum)
    return jagged_tensor(values, offsets)


def _dense_td(tree: dict, batch_size: torch.Size) -> TensorDict:
    """``{name: tensor | subtree}`` -> a TensorDict, unvalidated (every leaf comes from the schema)."""
    return TensorDict._new_unsafe({k: _dense_td(v, batch_size) if isinstance(v, dict) else v
                                   for k, v in tree.items()}, batch_size, nested=False)


def _nest(d: dict) -> dict:
    out: dict = {}
    for key, v in d.items():
        cur = out
        for part in key[:-1]:
            cur = cur.setdefault(part, {})
        cur[key[-1]] = v
    return out
