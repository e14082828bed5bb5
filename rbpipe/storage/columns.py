"""The column schema of a store, inferred from the first write, and TensorDict <-> column conversion.

Every tensor leaf becomes one column. A *fixed* column has the same trailing shape on every row; a
*ragged* column keeps each row's own trailing shape (same ndim and dtype). A ``str`` leaf (``NonTensorData``,
e.g. torchrl's prompt) becomes a *string column*: a ragged 1-D column of each row's UTF-8 bytes, dtype ``"str"``.
Both backends use this module, so the schema rules (and their :class:`SchemaError` messages) are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, is_tensor_collection
from tensordict.utils import is_non_tensor

from rbpipe.errors import NotAGroupError, SchemaError
from rbpipe.members import _NestedTensor, jagged_tensor  # noqa: F401 - jagged_tensor: re-exported
from rbpipe.trajectory import numpy_view

NestedKey = Any

# torch dtype -> (name, numpy storage dtype, extra trailing dim for complex)
_DTYPES: dict[torch.dtype, tuple[str, np.dtype]] = {
    torch.bool: ("bool", np.dtype(np.uint8)),
    torch.uint8: ("uint8", np.dtype(np.uint8)),
    torch.int8: ("int8", np.dtype(np.int8)),
    torch.int16: ("int16", np.dtype(np.int16)),
    torch.int32: ("int32", np.dtype(np.int32)),
    torch.int64: ("int64", np.dtype(np.int64)),
    torch.float16: ("float16", np.dtype(np.float16)),
    torch.bfloat16: ("bfloat16", np.dtype(np.uint16)),
    torch.float32: ("float32", np.dtype(np.float32)),
    torch.float64: ("float64", np.dtype(np.float64)),
    torch.complex64: ("complex64", np.dtype(np.float32)),
    torch.complex128: ("complex128", np.dtype(np.float64)),
}
_BY_NAME: dict[str, tuple[torch.dtype | None, np.dtype]] = {name: (dt, npdt) for dt, (name, npdt) in _DTYPES.items()}
#: dtype name of a string column: one ``str`` per row, kept as a ragged 1-D column of its UTF-8 bytes (FORMAT.md)
TEXT = "str"
_BY_NAME[TEXT] = (None, np.dtype(np.uint8))


def key_tuple(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def column_name(key: NestedKey) -> str:
    """Column name of a nested key: its parts joined by '.' (FORMAT.md)."""
    return ".".join(key_tuple(key))


def to_storage_np(t: torch.Tensor) -> np.ndarray:
    """Tensor -> numpy array in the storage dtype (bool as uint8, bfloat16 bits as uint16, complex as
    a trailing [..., 2] of reals)."""
    view = numpy_view(t)  # the common case, a plain CPU tensor: no copies of the tensor object made below
    if view is not None:
        return view.view(np.uint8) if view.dtype == np.bool_ else view
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8)
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).numpy()
    return t.numpy()


def from_storage_np(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Inverse of :func:`to_storage_np`; zero-copy when ``a`` is writable (copy-on-write map)."""
    if dtype_name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if dtype_name == "bool":
        return torch.from_numpy(a.view(np.bool_))
    if dtype_name.startswith("complex"):
        if a.size == 0:  # numpy may give an empty array any strides; view_as_complex wants stride 1
            return torch.zeros(a.shape[:-1], dtype=getattr(torch, dtype_name))
        return torch.view_as_complex(torch.from_numpy(np.ascontiguousarray(a)))
    return torch.from_numpy(a)


@dataclass
class Column:
    key: tuple[str, ...]
    dtype: str  # torch dtype name
    shape: tuple[int, ...] | None  # trailing shape of fixed columns; None when ragged
    ndim: int  # trailing ndim (ragged rows keep it)
    # derived once: they are read per column per group on the sampling hot path
    name: str = field(init=False, repr=False, compare=False)
    ragged: bool = field(init=False, repr=False, compare=False)
    np_dtype: np.dtype = field(init=False, repr=False, compare=False)
    complex: bool = field(init=False, repr=False, compare=False)
    text: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.name = column_name(self.key)
        self.ragged = self.shape is None
        self.text = self.dtype == TEXT
        self.np_dtype = _BY_NAME[self.dtype][1]
        self.complex = self.dtype.startswith("complex")

    def to_json(self) -> dict:
        return {"key": list(self.key), "column": self.name, "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape), "ndim": self.ndim}

    @classmethod
    def from_json(cls, d: dict) -> Column:
        return cls(tuple(d["key"]), d["dtype"], None if d["shape"] is None else tuple(d["shape"]), d["ndim"])


@dataclass
class GroupColumns:
    """One group as numpy columns: fixed -> array [n, *shape]; ragged -> (flat values, shapes [n, ndim])."""
    n: int
    fixed: dict[tuple, np.ndarray] = field(default_factory=dict)
    ragged: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def row_elements(shapes: np.ndarray) -> np.ndarray:
    """Elements per row of a ragged column from its ``[rows, ndim]`` shapes (a 0-d row holds one)."""
    return shapes.prod(1) if shapes.shape[1] else np.ones(len(shapes), np.int64)


def ragged_sizes(shapes: np.ndarray, col: Column) -> np.ndarray:
    """Scalars per row of a ragged column (complex values count two)."""
    return row_elements(shapes) * (2 if col.complex else 1)


def take_ragged(values: np.ndarray, shapes: np.ndarray, col: Column, order: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``order`` of a ragged column held as (flat values, shapes). (A loop of slices: faster than
    building a flat fancy index with ``np.repeat``; figures: docs/DESIGN.md, Figures behind code choices.)"""
    sizes = ragged_sizes(shapes, col)
    starts = (np.cumsum(sizes) - sizes)[order].tolist()
    parts = [values[s:s + k] for s, k in zip(starts, sizes[order].tolist(), strict=True)]
    return (np.concatenate(parts) if parts else values[:0]), shapes[order]


def take_columns(columns: Sequence[Column], table: dict, rows: np.ndarray) -> dict:
    """Rows of a decoded block (fixed columns as arrays, ragged ones as ``(values, offsets, shapes)``):
    fixed columns fancy-indexed, ragged ones as (flat values, shapes) in the order asked."""
    out = {}
    for c in columns:
        if c.ragged:
            values, _, shapes = table[c.key]
            out[c.key] = take_ragged(values, shapes, c, rows)
        else:
            out[c.key] = table[c.key][rows]
    return out


def slice_columns(columns: Sequence[Column], table: dict, first: int, stop: int) -> dict:
    """Consecutive rows ``first..stop`` of a decoded block: views, one slice per column."""
    out = {}
    for c in columns:
        if c.ragged:
            values, offsets, shapes = table[c.key]
            out[c.key] = (values[offsets[first]:offsets[stop]], shapes[first:stop])
        else:
            out[c.key] = table[c.key][first:stop]
    return out


def empty_columns(columns: Sequence[Column]) -> dict:
    """Zero rows of every column, in the shapes ``take_columns`` returns."""
    return {c.key: ((np.zeros(0, c.np_dtype), np.zeros((0, c.ndim), np.int64)) if c.shape is None  # ragged
                    else np.zeros((0, *c.shape), c.np_dtype)) for c in columns}


def _rows(td: TensorDictBase) -> list[TensorDictBase] | None:
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        return list(td.tensordicts)
    if isinstance(td, LazyStackedTensorDict):
        return list(td.unbind(0))
    return None


def _is_jagged(t: torch.Tensor) -> bool:
    """A ``torch.nested`` leaf; plain tensors answer without going through a subclass's dispatch."""
    return type(t) is not torch.Tensor and t.is_nested


def _leaf_keys(td: TensorDictBase) -> list[tuple[str, ...]]:
    return sorted(key_tuple(k) for k in td.keys(True, True, is_leaf=_is_tensor_leaf))


def _is_tensor_leaf(cls) -> bool:
    return issubclass(cls, torch.Tensor)


def _leaves(td: TensorDictBase, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], torch.Tensor]:
    """Every tensor leaf by nested key, in one walk. Reads the plain dict behind a ``TensorDict``: per-key
    ``get`` on the rows of a lazy stack cost more than the whole Arrow write of a group."""
    out = {}
    for k, v in (td._tensordict.items() if type(td) is TensorDict else td.items()):
        kind = type(v)  # exact type checks first: isinstance against the ABCs is slow
        if kind is torch.Tensor or (kind is not TensorDict and isinstance(v, torch.Tensor)):
            out[prefix + (k,)] = v
        elif kind is TensorDict:
            out.update(_leaves(v, prefix + (k,)))
        elif is_non_tensor(v):  # a str leaf (NonTensorData / NonTensorStack): a string column
            out[prefix + (k,)] = v
        elif isinstance(v, TensorDictBase):
            out.update(_leaves(v, prefix + (k,)))
    return out


def _text_keys(td: TensorDictBase, rows) -> list[tuple[str, ...]]:
    """Keys of the non-tensor leaves of a group (of its first row when it is a lazy stack)."""
    return sorted(k for k, v in _leaves(td if rows is None else rows[0]).items() if is_non_tensor(v))


def strings_of(value: Any, n: int, name: str) -> list[str]:
    """The ``n`` strings of a non-tensor leaf; anything but ``str`` is refused (a store never pickles)."""
    if isinstance(value, NonTensorData):
        data = value.data
        texts = [data] * n if value.batch_dims else [data]
    else:
        texts = value.tolist()
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None or len(texts) != n:
        what = type(bad).__name__ if bad is not None else f"{len(texts)} values for {n} rows"
        raise SchemaError(f"key {name!r} holds {what}: a store keeps tensors and str (one per row) only, never "
                          "pickled objects; convert it to a tensor or a str, or drop it")
    return texts


def text_columns(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings -> (UTF-8 bytes back to back, byte lengths as ``[n, 1]`` shapes): a ragged 1-D uint8 column."""
    data = [t.encode() for t in texts]
    return (np.frombuffer(b"".join(data), np.uint8),
            np.fromiter(map(len, data), np.int64, len(data)).reshape(-1, 1))


def decode_texts(parts: list[tuple[np.ndarray, np.ndarray]]) -> list[str]:
    """Inverse of :func:`text_columns` over the parts of a read."""
    out: list[str] = []
    for values, shapes in parts:
        raw, at = values.tobytes(), 0
        for n in shapes[:, 0].tolist():
            out.append(raw[at:at + n].decode())
            at += n
    return out


#: names a ragged column ``c`` also occupies on disk: Arrow's ``c.__shape`` field, Zarr's ``c.values``,
#: ``c.start`` and ``c.shape`` arrays (FORMAT.md)
RAGGED_SUFFIXES = (".__shape", ".values", ".start", ".shape")


def check_group(td: Any) -> TensorDictBase:
    """``td`` when it is a TensorDict (or tensorclass): a plain tensor or list has no keys to name columns by."""
    if is_tensor_collection(td):
        return td
    rows = isinstance(td, (list, tuple)) and td and all(isinstance(x, TensorDictBase) for x in td)
    hint = ("stack the rows first: tensordict.lazy_stack(rows)" if rows
            else "wrap it: TensorDict({'name': tensor}, batch_size=[n])")
    raise NotAGroupError(f"a group must be a TensorDict with batch_size [n] (one row per member), got "
                         f"{type(td).__name__}; {hint}")


def physical_names(c: Column) -> tuple[str, ...]:
    """Every name column ``c`` occupies on disk on either backend (Arrow fields, Zarr arrays)."""
    return (c.name, *(c.name + s for s in RAGGED_SUFFIXES)) if c.ragged else (c.name,)


def _name_problem(c: Column) -> str | None:
    """Why ``c`` can never be stored on one of the backends (checked before its schema is committed: a
    committed schema that a backend cannot lay out would make the store refuse every group), or None."""
    if any(part == "" for part in c.key):
        return f"key {c.key!r} has an empty part; rename it"
    if "/" in c.name:
        return f"key {c.key!r} contains '/', which Zarr reads as a path separator; rename it"
    if set(c.name) == {"."}:
        return f"column name {c.name!r} is only dots, which no Zarr array may be named; rename the key"
    if c.name.startswith("__"):
        return f"column name {c.name!r} starts with '__', which Zarr v3 reserves; rename the key"
    if c.ragged and c.ndim == 0:
        return f"key {c.name!r} holds one scalar per row and cannot be ragged; remove it from ragged_keys"
    if c.shape is not None and 0 in c.shape:  # (a fixed column)
        return (f"key {c.name!r} has the zero-size shape {c.shape} in every row: a fixed column must hold "
                "data; declare it in ragged_keys if its size varies (rows may then be empty), or drop it")
    return None


def check_storable(columns: Sequence[Column]) -> None:
    """Raise SchemaError unless both backends can lay out ``columns``: valid names, no empty fixed shape, and
    no two columns on one on-disk name, letter case ignored (a case-insensitive file system would put two
    Zarr arrays "A" and "a" in one directory)."""
    seen: dict[str, Column] = {}
    for c in columns:
        problem = _name_problem(c)
        if problem:
            raise SchemaError(problem)
        for name in physical_names(c):
            other = seen.setdefault(name.lower(), c)
            if other is not c:
                raise SchemaError(
                    f"keys {other.key!r} and {c.key!r} would both be stored as {name!r} (column names join key "
                    f"parts with '.', a ragged column adds {', '.join(RAGGED_SUFFIXES)}, and letter case does "
                    "not tell names apart); rename one of them")


class ColumnSet:
    """Columns of a store. ``infer`` builds it from the first write; ``split`` checks later writes."""

    def __init__(self, columns: Sequence[Column]):
        self.columns = list(columns)
        self.by_key = {c.key: c for c in self.columns}

    def columns_of(self, keys=None) -> list[Column]:
        """All columns, or those of ``keys``."""
        return self.columns if keys is None else [self.by_key[k] for k in keys]

    @property
    def has_ragged(self) -> bool:
        return any(c.ragged for c in self.columns)

    def to_json(self) -> list[dict]:
        return [c.to_json() for c in self.columns]

    @classmethod
    def from_json(cls, cols: list[dict]) -> ColumnSet:
        return cls([Column.from_json(c) for c in cols])

    @classmethod
    def infer(cls, td: TensorDictBase, ragged_keys: Sequence[NestedKey] = ()) -> ColumnSet:
        """The schema of a store's first group; refuses (SchemaError) what either backend could never store."""
        if check_group(td).ndim != 1 or td.shape[0] < 1:
            raise SchemaError(f"a group must be a TensorDict with one batch dimension of at least one member, got "
                              f"batch_size={tuple(td.batch_size)}")
        declared = {key_tuple(k) for k in ragged_keys}
        rows = _rows(td)
        cols = [Column(key, TEXT, None, 1) for key in _text_keys(td, rows)]
        for key in _leaf_keys(td):
            if rows is None:
                t = td.get(key)
                if _is_jagged(t):  # a jagged tensor [n, j] (the "nested" read layout): ragged by definition
                    if t.dtype not in _DTYPES:
                        raise SchemaError(f"key {column_name(key)!r} has dtype {t.dtype}, which the store "
                                          f"cannot hold; cast it to one of {sorted(n for n, _ in _DTYPES.values())}")
                    cols.append(Column(key, _DTYPES[t.dtype][0], None, t.dim() - 1))
                    continue
                shapes = {tuple(t.shape[1:])}
                dtype = t.dtype
            else:
                ts = [r.get(key) for r in rows]
                shapes = {tuple(x.shape) for x in ts}
                dtype = ts[0].dtype
            if dtype not in _DTYPES:
                raise SchemaError(f"key {column_name(key)!r} has dtype {dtype}, which the store cannot "
                                  f"hold; cast it to one of {sorted(n for n, _ in _DTYPES.values())}")
            ndims = {len(s) for s in shapes}
            if len(ndims) > 1:
                raise SchemaError(f"key {column_name(key)!r} has rows of different ndim {sorted(ndims)}; "
                                  "ragged fields may vary in size but not in number of dimensions")
            ragged = key in declared or len(shapes) > 1
            shape = None if ragged else next(iter(shapes))
            cols.append(Column(key, _DTYPES[dtype][0], shape, ndims.pop()))
        if not cols:
            raise SchemaError("the first group has no tensor fields; nothing to store")
        cols.sort(key=lambda c: c.key)  # string columns among the others: sorted key order (FORMAT.md)
        check_storable(cols)
        return cls(cols)

    def split(self, td: TensorDictBase) -> GroupColumns:
        """Check ``td`` against the schema and convert it to columns (nothing is written on error)."""
        if check_group(td).ndim != 1 or td.shape[0] < 1:
            raise SchemaError(f"a group must be a TensorDict of batch_size [n>=1], got {tuple(td.shape)}")
        rows = _rows(td)
        leaves = [_leaves(td)] if rows is None else [_leaves(r) for r in rows]
        expected = self.by_key.keys()
        if any(lv.keys() != expected for lv in leaves):
            keys = set().union(*(lv.keys() for lv in leaves))
            missing = sorted({c.name for c in self.columns for lv in leaves if c.key not in lv})
            new = sorted(column_name(k) for k in keys if k not in self.by_key)
            what = "; ".join(x for x in (f"missing key(s) {', '.join(missing)}" if missing else "",
                                         f"new key(s) {', '.join(new)}" if new else "") if x)
            raise SchemaError(f"group does not match the store schema: {what}. A store keeps the keys of its "
                              "first write; write to a new store to change the layout")
        out = GroupColumns(n=td.shape[0])
        for c in self.columns:
            if c.text:
                texts = (strings_of(leaves[0][c.key], out.n, c.name) if rows is None else
                         [t for lv in leaves for t in strings_of(lv[c.key], 1, c.name)])
                out.ragged[c.key] = text_columns(texts)
                continue
            if rows is None or not c.ragged:
                if rows is None:
                    t = leaves[0][c.key]
                    if _is_jagged(t):
                        out.ragged[c.key] = self._split_jagged(c, t)
                        continue
                else:
                    try:
                        t = torch.stack([lv[c.key] for lv in leaves])
                    except RuntimeError:
                        seen = sorted({tuple(lv[c.key].shape) for lv in leaves})
                        raise SchemaError(f"key {c.name!r} has fixed shape {c.shape} in the store but rows "
                                          f"of shapes {seen}; declare it in ragged_keys when creating "
                                          "the store") from None
                self._check(c, t.dtype, tuple(t.shape[1:]), t.ndim - 1)
                if c.ragged:
                    a = to_storage_np(t)
                    shapes = np.tile(np.asarray(t.shape[1:], dtype=np.int64), (t.shape[0], 1))
                    out.ragged[c.key] = (a.reshape(-1) if not c.complex else a.reshape(-1, 2), shapes)
                else:
                    out.fixed[c.key] = to_storage_np(t)
            else:
                ts = [lv[c.key] for lv in leaves]
                want = _BY_NAME[c.dtype][0]
                for t in ts:
                    if t.dtype != want or t.ndim != c.ndim:
                        self._check(c, t.dtype, None, t.ndim)
                flat = torch.cat(ts if c.ndim == 1 else [t.reshape(-1) for t in ts])  # one copy, in C
                shapes = np.asarray([tuple(t.shape) for t in ts], dtype=np.int64).reshape(len(ts), c.ndim)
                out.ragged[c.key] = (to_storage_np(flat).reshape((-1, 2) if c.complex else -1), shapes)
        return out

    def _split_jagged(self, c: Column, t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """A jagged ``torch.nested`` leaf -> (flat values, shapes): what a store read with
        ``ragged_layout="nested"`` returns can be written back as it is."""
        if not c.ragged:
            raise SchemaError(f"key {c.name!r} is a nested (jagged) tensor but the store holds it with fixed "
                              f"shape {c.shape}; write dense rows, or a store that declares it in ragged_keys")
        if type(t) is _NestedTensor and t._lengths is None and t._ragged_idx == 1 and t._values.dim() == 1:
            values, offsets = t._values, t._offsets  # read directly: a call through the subclass is slow
        else:
            if t.dim() != 2:
                raise SchemaError(f"key {c.name!r}: only [rows, j] jagged tensors can be written; got {t.dim()}-D")
            values, offsets = t.values(), t.offsets()  # type: ignore[attr-defined]  # (jagged-only: not in torch's stub)
        self._check(c, values.dtype, None, values.dim())
        o = offsets.numpy()
        shapes = np.diff(o).reshape(-1, 1).astype(np.int64, copy=False)
        return to_storage_np(values[int(o[0]):int(o[-1])]).reshape((-1, 2) if c.complex else -1), shapes

    @staticmethod
    def _check(c: Column, dtype: torch.dtype, shape, ndim: int) -> None:
        if _DTYPES.get(dtype, (None,))[0] != c.dtype:
            raise SchemaError(f"key {c.name!r} changed dtype: the store holds {c.dtype}, the group has "
                              f"{dtype}; cast it back (e.g. .to(torch.{c.dtype}))")
        if ndim != c.ndim:
            raise SchemaError(f"key {c.name!r} changed number of dimensions per row: store {c.ndim}, "
                              f"group {ndim}")
        if c.shape is not None and shape is not None and shape != c.shape:
            raise SchemaError(f"key {c.name!r} changed shape per row: the store holds {c.shape}, the group "
                              f"has {shape}; if this field varies in length, declare it in ragged_keys "
                              "when creating the store")
