"""The numba kernels behind :mod:`rbpipe.storage.gather` (imported only when numba is installed).

Kept in their own module so that numba compiles them once and caches them on disk (``cache=True`` needs
module-level functions), and so that importing rbpipe never imports numba.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """``memcpy`` between raw addresses: one kernel copies from any mapped or allocated buffer."""

    def codegen(context, builder, signature, args):
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t),
                           n, 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@njit(nogil=True, cache=True)
def whole_group_positions(rows: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Positions (in ``starts``/``stops``) of the groups ``rows`` lists, when ``rows`` is a sequence of whole
    groups, each in row order; an empty array otherwise (the caller then reads row runs)."""
    out = np.empty(len(rows), np.int64)
    k = 0
    i = 0
    while i < len(rows):
        g = np.searchsorted(stops, rows[i], side="right")
        if g >= len(stops) or rows[i] != starts[g] or i + stops[g] - starts[g] > len(rows):
            return out[:0]
        for j in range(stops[g] - starts[g]):
            if rows[i + j] != starts[g] + j:
                return out[:0]
        out[k] = g
        k += 1
        i += stops[g] - starts[g]
    return out[:k]


@njit(parallel=True, nogil=True, cache=True)
def gather_arrays(plans: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate, array by array, the arrays of several blocks into one new buffer.

    ``plans[b]`` holds block ``b``'s array addresses, then their byte counts. Returns the buffer, where each
    concatenated array starts in it (64-byte aligned) and its byte count. The copy runs in tasks of at most
    ``chunk`` bytes over all threads: one thread per range would leave cores idle (ranges differ widely in size)."""
    blocks, arrays = plans.shape[0], plans.shape[1] // 2
    sizes = np.zeros(arrays, np.int64)
    tasks = 0
    for b in range(blocks):
        for a in range(arrays):
            sizes[a] += plans[b, arrays + a]
            tasks += (plans[b, arrays + a] + chunk - 1) // chunk
    starts = np.empty(arrays, np.int64)
    end = 0
    for a in range(arrays):
        starts[a] = end
        end += (sizes[a] + 63) // 64 * 64
    buf = np.empty(end + 64, np.uint8)
    base = buf.ctypes.data
    shift = (64 - base % 64) % 64
    task_dst = np.empty(tasks, np.int64)
    task_src = np.empty(tasks, np.int64)
    task_len = np.empty(tasks, np.int64)
    k = 0
    for a in range(arrays):
        dst = base + shift + starts[a]
        for b in range(blocks):
            n = plans[b, arrays + a]
            done = 0
            while done < n:
                task_dst[k] = dst + done
                task_src[k] = plans[b, a] + done
                task_len[k] = min(chunk, n - done)
                done += task_len[k]
                k += 1
            dst += n
    for t in prange(tasks):
        _memcpy(task_dst[t], task_src[t], task_len[t])  # type: ignore[call-arg, unused-ignore]  # numba: @intrinsic adds typingctx (untyped in older numba)
    return buf, starts + shift, sizes


@njit(parallel=True, nogil=True, cache=True)
def pad_rows(values: np.ndarray, row_bytes: np.ndarray, out: np.ndarray) -> None:
    """Row ``i`` of ``out`` (``[rows, width]`` bytes) = the next ``row_bytes[i]`` bytes of ``values``, then
    zeros: a ragged field right-padded to its longest row, rows spread over the threads."""
    starts = np.empty(len(row_bytes), np.int64)
    pos = 0
    for i in range(len(row_bytes)):
        starts[i] = pos
        pos += row_bytes[i]
    for i in prange(len(row_bytes)):
        n = row_bytes[i]
        out[i, :n] = values[starts[i]:starts[i] + n]
        out[i, n:] = 0
