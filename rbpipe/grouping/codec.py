"""The staging payload codec: a trajectory's TensorDict to bytes and back, read by plain slicing (no pickle:
a planted file can at worst be refused as torn). :mod:`rbpipe.grouping.staging` writes and reads these files.

Payload format (version 1), little-endian::

    b"RBPS" | version: u8 = 1 (or 2, below) | layout length: u32 | dim count: u32 | layout: UTF-8 JSON
            | dims: int64 x dim count | leaf bytes, back to back

    layout = {"batch_ndim": int, "leaves": [[[key part, ...], dtype name (torch, e.g. "float32"), ndim], ...]}
    dims   = the batch size, then each leaf's shape (version 2: its per-step dims), in layout order

Each leaf is a tensor's raw bytes in C order (native little-endian), ``prod(shape) * itemsize`` of them. The
layout (keys, dtypes, ranks) is the same for every trajectory of a run, so both sides cache it: only the dims
vary.

Version 2 (written only when a trajectory has a leaf of another kind; version 1 is read as before) lets a leaf
entry carry a fourth element, its kind, for trajectories with batch size ``[T]``:

- ``[key, dtype, ndim, "ragged"]``: one tensor per step whose shapes differ between steps (torchrl's
  lazy-stacked LLM steps, e.g. per-token rewards). Its dims are the ``T`` step shapes (``T * ndim`` integers);
  its bytes are the steps' raw bytes back to back.
- ``[key, "str", 1, "str"]``: one Python ``str`` per step (``NonTensorData``/``NonTensorStack``: a prompt
  ``"query"``, text). Its dims are the ``T`` byte lengths; its bytes are the steps' UTF-8 encodings back to back.

Any other non-tensor leaf is refused (:class:`~rbpipe.errors.BadTrajectoryError`): nothing is ever pickled.
A version 2 payload reads back as a ``LazyStackedTensorDict`` of ``T`` steps (strings as ``NonTensorData``);
its leaves whose steps all have one shape are written as version 1 leaves (no kind).
"""

from __future__ import annotations

import json
import math
import struct

import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    TensorDict,
    TensorDictBase,
    lazy_stack,
)
from tensordict.utils import is_non_tensor

from rbpipe.errors import BadTrajectoryError, RbpipeError
from rbpipe.grouping.registry import decode_tensor


class StagingError(RbpipeError):
    """A staged trajectory payload cannot be written or read back."""


#: dtypes numpy cannot hold: their bytes are taken through a uint8 view
_VIEW_ONLY = frozenset({torch.bfloat16, torch.complex32} | {getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64")
    if hasattr(torch, n)})


MAGIC, VERSION = b"RBPS", 1
_PREFIX = struct.Struct("<4sBII")
#: the dtypes a payload may name (a header is data: never ``getattr`` an arbitrary name)
_DTYPES = {str(dt)[6:]: dt for dt in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
    *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "uint16", "uint32", "uint64") if hasattr(torch, n)])}
_ITEMSIZE = {name: dt.itemsize for name, dt in _DTYPES.items()}
_HEADER_MAX = 1 << 24


def _raw(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    try:
        raw = None if t.dtype in _VIEW_ONLY else t.numpy().tobytes()
    except (TypeError, RuntimeError):  # e.g. a conjugate or negative view
        raw = None
    if raw is None:
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return t, raw


_LAYOUTS: dict = {}  # (batch ndim, ((key, dtype name, ndim), ...)) -> layout JSON bytes, on the writing side
_PARSED: dict = {}  # layout JSON bytes -> checked ((key, dtype name, itemsize, ndim), ...), on the reading side
_CACHE_MAX = 256


def _layout_bytes(signature: tuple) -> bytes:
    text = _LAYOUTS.get(signature)
    if text is None:
        batch_ndim, leaves = signature
        text = json.dumps({"batch_ndim": batch_ndim, "leaves": [
            [[k] if isinstance(k, str) else list(k), *rest] for k, *rest in leaves]}).encode()
        if len(_LAYOUTS) < _CACHE_MAX:
            _LAYOUTS[signature] = text
    return text


def encode_td(td: TensorDictBase) -> bytes:
    """TensorDict -> payload bytes (format in the module docstring): raw tensor buffers, no serializer."""
    leaves = _tensor_leaves(td)
    if leaves is None:  # non-tensor leaves, or steps of different shapes: version 2
        return _encode_steps(td)
    signature, dims, chunks = [], list(td.batch_size), []
    for key, value in leaves:
        t, raw = _raw(value)
        signature.append((key, str(t.dtype)[6:], t.ndim))
        dims.extend(t.shape)
        chunks.append(raw)
    layout = _layout_bytes((td.batch_dims, tuple(signature)))
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(layout), len(dims)), layout,
                     struct.pack(f"<{len(dims)}q", *dims), *chunks])


def _tensor_leaves(td: TensorDictBase) -> list | None:
    """``(key, tensor)`` of every leaf of a TensorDict of tensors only (the common case), else None."""
    out: list = []
    return out if _walk(td, (), out) else None


def _walk(td, prefix: tuple, out: list) -> bool:
    if type(td) is not TensorDict:
        return False
    for k, v in td._tensordict.items():
        kind = type(v)
        if kind is torch.Tensor or (kind is not TensorDict and isinstance(v, torch.Tensor)):
            out.append((prefix + (k,) if prefix else k, v))
        elif kind is not TensorDict or not _walk(v, prefix + (k,), out):
            return False
    return True


def _row_leaves(td: TensorDictBase, prefix: tuple, out: dict) -> None:
    """Leaves of one step: tensors, ``str`` (from ``NonTensorData``), anything else as it is (refused later)."""
    for k, v in td.items():
        key = prefix + (k,)
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif is_non_tensor(v):
            out[key] = v.data if isinstance(v, NonTensorData) else v.tolist()
        elif isinstance(v, TensorDictBase):
            _row_leaves(v, key, out)
        else:
            out[key] = v


def _steps(td: TensorDictBase) -> list[dict]:
    if td.batch_dims != 1:
        raise BadTrajectoryError(f"a trajectory with non-tensor leaves or steps of different shapes must have "
                                 f"batch_size [T], got {tuple(td.batch_size)}")
    rows = td.tensordicts if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0 else td.unbind(0)
    steps = []
    for row in rows:
        leaves: dict = {}
        _row_leaves(row, (), leaves)
        steps.append(leaves)
    if any(s.keys() != steps[0].keys() for s in steps):
        diff = sorted(".".join(k) for k in set().union(*steps) - set(steps[0]).intersection(*steps))
        raise BadTrajectoryError(f"the steps of a trajectory carry different keys ({', '.join(diff)}): every "
                                 "step must have the same leaves")
    return steps


def _encode_steps(td: TensorDictBase) -> bytes:
    """Version 2: per key, a dense leaf (equal shapes), a ragged one (one shape per step) or one str a step."""
    steps = _steps(td)
    signature, dims, chunks = [], list(td.batch_size), []
    for key in steps[0]:
        values = [s[key] for s in steps]
        name = key[0] if len(key) == 1 else key
        if all(isinstance(v, str) for v in values):
            data = [v.encode() for v in values]
            signature.append((name, "str", 1, "str"))
            dims.extend(len(b) for b in data)
            chunks.extend(data)
        elif all(isinstance(v, torch.Tensor) and not v.is_nested for v in values):
            _tensor_steps(name, values, signature, dims, chunks)
        else:
            bad = next(v for v in values if not isinstance(v, (str, torch.Tensor)) or isinstance(v, torch.Tensor)
                       and v.is_nested)
            raise BadTrajectoryError(
                f"leaf {'.'.join(key)!r} holds {type(bad).__name__}: a staged trajectory may hold tensors and str "
                "only (rbpipe never pickles data); convert it to a tensor or a str, or remove it")
    layout = _layout_bytes((td.batch_dims, tuple(signature)))
    return b"".join([_PREFIX.pack(MAGIC, 2, len(layout), len(dims)), layout,
                     struct.pack(f"<{len(dims)}q", *dims), *chunks])


def _tensor_steps(name, values: list, signature: list, dims: list, chunks: list) -> None:
    dtypes, ndims = {v.dtype for v in values}, {v.ndim for v in values}
    if len(dtypes) > 1 or len(ndims) > 1:
        raise BadTrajectoryError(f"leaf {name!r} changes dtype or number of dimensions between steps "
                                 f"({sorted(map(str, dtypes))}, ndim {sorted(ndims)}): only its sizes may vary")
    if len({v.shape for v in values}) == 1:  # same shape every step: one dense leaf, as version 1
        t, raw = _raw(torch.stack(values))
        signature.append((name, str(t.dtype)[6:], t.ndim))
        dims.extend(t.shape)
        chunks.append(raw)
        return
    signature.append((name, str(values[0].dtype)[6:], values[0].ndim, "ragged"))
    for v in values:
        t, raw = _raw(v)
        dims.extend(t.shape)
        chunks.append(raw)


def _torn(why: str) -> StagingError:
    return StagingError(f"not a staged payload ({why}): torn by a kill mid-write, or not written by rbpipe")


def _parse_layout(text: bytes) -> tuple[int, tuple]:
    """Check a layout (only JSON lists, strings and integers: checked here, never evaluated)."""
    cached = _PARSED.get(text)
    if cached is not None:
        return cached
    try:
        layout = json.loads(text)
        batch_ndim, entries = layout["batch_ndim"], layout["leaves"]
        leaves = []
        for parts, dtype, ndim, *kind in entries:
            if not (type(parts) is list and parts and {type(p) for p in parts} == {str}):
                raise TypeError("a key is a list of strings")
            if type(ndim) is not int or not 0 <= ndim <= 64:
                raise TypeError("bad rank")
            kind = kind[0] if kind else None
            if kind not in (None, "ragged", "str") or (kind == "str") != (dtype == "str") or (
                    kind is not None and batch_ndim != 1) or (kind == "str" and ndim != 1):
                raise TypeError(f"bad leaf kind {kind!r}")
            itemsize = 1 if kind == "str" else _ITEMSIZE[dtype]
            leaves.append((parts[0] if len(parts) == 1 else tuple(parts), dtype, itemsize, ndim, kind))
        if type(batch_ndim) is not int or not 0 <= batch_ndim <= 64:
            raise TypeError("bad batch rank")
    except (ValueError, KeyError, TypeError) as err:
        raise _torn(f"bad layout: {err}") from err
    parsed = (batch_ndim, tuple(leaves))
    if len(_PARSED) < _CACHE_MAX:
        _PARSED[text] = parsed
    return parsed


#: the dtype ``decode_leaves`` gives a leaf of one ``str`` per step; a ragged leaf's is ``(RAGGED, dtype name)``
STR, RAGGED = "str", "ragged"


#: dtypes of decoded leaves that are one tensor (version 1's only kind): ``dtype in PLAIN``
PLAIN = frozenset(_ITEMSIZE)


def is_plain(dtype) -> bool:
    """Whether a decoded leaf (its ``dtype``) is one tensor (version 1's only kind)."""
    return dtype in PLAIN


def decode_leaves(data: bytes) -> tuple[tuple, list[tuple]]:
    """bytes -> ``(batch_size, [(key, dtype, shape, raw bytes), ...])``; refuses anything malformed. A ragged
    leaf has dtype ``(RAGGED, name)`` and one shape per step; a str leaf dtype ``STR`` and one byte length per
    step."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise _torn("too short")
    magic, version, size, ndims = _PREFIX.unpack_from(view)
    at = _PREFIX.size + size
    end_dims = at + 8 * ndims
    if magic != MAGIC or version not in (1, 2) or size > _HEADER_MAX or end_dims > len(view):
        raise _torn("bad prefix")
    batch_ndim, layout = _parse_layout(bytes(view[_PREFIX.size:at]))
    dims = struct.unpack_from(f"<{ndims}q", view, at)
    steps = dims[0] if batch_ndim == 1 and dims else 0
    if batch_ndim + sum(nd if kind is None else steps * nd for _, _, _, nd, kind in layout) != ndims or (
            dims and min(dims) < 0) or (version == 1 and any(leaf[4] for leaf in layout)):
        raise _torn("dims do not match the layout")
    at, i = end_dims, batch_ndim
    leaves = []
    for key, dtype, itemsize, ndim, kind in layout:
        if kind is None:
            shape = dims[i:i + ndim]
            i += ndim
            count = math.prod(shape)
        else:
            flat = dims[i:i + steps * ndim]
            i += steps * ndim
            shape = flat if kind == STR else tuple(flat[j:j + ndim] for j in range(0, len(flat), ndim))
            count = sum(flat) if kind == STR else sum(math.prod(s) for s in shape)
            dtype = STR if kind == STR else (RAGGED, dtype)
        end = at + count * itemsize
        if end > len(view):
            raise _torn("missing bytes")
        leaves.append((key, dtype, shape, view[at:end]))
        at = end
    if at != len(view):
        raise _torn("trailing bytes")
    return dims[:batch_ndim], leaves


def td_from_leaves(batch_size: tuple, leaves: list[tuple]) -> TensorDictBase:
    """Inverse of :func:`encode_td` once decoded by :func:`decode_leaves` (version 2 leaves: a lazy stack of
    steps, as torchrl's LLM layout)."""
    if not all(is_plain(dtype) for _, dtype, _, _ in leaves):
        return _steps_from_leaves(batch_size[0], leaves)
    td = TensorDict(batch_size=batch_size)
    for key, dtype, shape, raw in leaves:
        td.set(key, decode_tensor(raw, dtype, shape))
    return td


def _steps_from_leaves(steps: int, leaves: list[tuple]) -> TensorDictBase:
    rows = [TensorDict() for _ in range(steps)]
    for key, dtype, shape, raw in leaves:
        if dtype == STR:
            text, at = bytes(raw), 0
            for row, n in zip(rows, shape, strict=True):
                row.set_non_tensor(key, text[at:at + n].decode())
                at += n
        elif is_plain(dtype):
            for row, t in zip(rows, decode_tensor(raw, dtype, shape).unbind(0), strict=True):
                row.set(key, t)
        else:
            flat = decode_tensor(raw, dtype[1], (len(raw) // _ITEMSIZE[dtype[1]],))
            for row, t, s in zip(rows, flat.split([math.prod(s) for s in shape]), shape, strict=True):
                row.set(key, t.reshape(s))
    return lazy_stack(rows, 0)


def decode_td(data: bytes) -> TensorDict:
    return td_from_leaves(*decode_leaves(data))
