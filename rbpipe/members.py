"""A group's members as one TensorDict: the column layout shared by grouping (which builds it) and storage
(which writes it), so that neither imports the other.

Members of one layout are concatenated leaf by leaf from their staged bytes (one decode per leaf, no
TensorDict per member). One-step members whose 2-D leaves differ in length (LLM tokens and log-probs)
become ``[n, j]`` jagged ``torch.nested`` leaves: one values tensor plus offsets, the form group stores
accept (``rbpipe.storage.protocol.GroupStore.accepts_jagged``) and write as cheaply as dense leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

try:  # the class behind torch.nested.nested_tensor_from_jagged, built without its view-tracking dispatch
    from torch.nested._internal.nested_tensor import NestedTensor as _NestedTensor  # (cheaper per call)
except ImportError:  # a torch that moved it: the public constructor
    _NestedTensor = None  # type: ignore[misc, assignment]  # (the optional-import idiom: None = not available)


def jagged_tensor(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A ``[rows, j]`` jagged ``torch.nested`` tensor over ``values`` (no copy), rows cut at ``offsets``.

    Examples:
        >>> t = jagged_tensor(torch.arange(5.0), torch.tensor([0, 2, 5]))
        >>> [row.tolist() for row in t.unbind()]
        [[0.0, 1.0], [2.0, 3.0, 4.0]]
    """
    if _NestedTensor is not None:
        return _NestedTensor(values, offsets)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def concat_leaves(payloads: Sequence[tuple[Any, list]], jagged: Sequence[bool], n: int,
                  decode: Callable[[bytes, Any, tuple], torch.Tensor]) -> TensorDict:
    """Members' leaves concatenated into one TensorDict of batch size ``[n]``.

    ``payloads``: per member ``(batch_size, leaves)``, each leaf ``(key, dtype, shape, raw bytes)`` in the
    same order for every member; ``jagged[i]``: leaf ``i`` differs in length across (one-step) members and
    becomes a jagged leaf; ``decode(raw, dtype, shape)`` makes a tensor of raw bytes."""
    group = TensorDict(batch_size=[n])
    for i, ((key, dtype, shape0, _), is_jagged) in enumerate(zip(payloads[0][1], jagged, strict=True)):
        column = [leaves[i] for _, leaves in payloads]
        data = b"".join(raw for *_, raw in column)
        if is_jagged:
            offsets = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor([shape[1] for _, _, shape, _ in column]), 0, out=offsets[1:])
            group.set(key, jagged_tensor(decode(data, dtype, (int(offsets[-1]),)), offsets))
        else:
            group.set(key, decode(data, dtype, (n, *shape0[1:])))
    return group
