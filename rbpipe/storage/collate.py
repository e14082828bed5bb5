"""The ``collate_fn`` torchrl's ``ReplayBuffer`` uses for group stores, registered as their default.

torchrl (0.14) picks a buffer's default ``collate_fn`` from a closed list of its own storage classes and
raises ``NotImplementedError`` for any other, so ``ReplayBuffer(storage=ArrowStorage(path))`` failed until a
``collate_fn`` was passed. Group stores return one ready TensorDict per read, as torchrl's ``TensorStorage``
does (whose default is the identity), so the lookup is wrapped to answer the identity for them and to defer to
torchrl for every other storage. Subclassing ``TensorStorage`` instead would bring its tensor bookkeeping,
which torchrl's samplers then inspect. The wrapped function is private to torchrl: pyproject pins
``torchrl<0.15``, and ``tests/storage/test_torchrl_compat.py`` fails if a release moves it.
"""

from __future__ import annotations

import importlib
from typing import Any

#: torchrl modules that look the default up (each imported the function by name).
_LOOKUP_MODULES = ("torchrl.data.replay_buffers.replay_buffers.base",
                   "torchrl.data.replay_buffers.replay_buffers.ensemble")


def collate_identity(data: Any) -> Any:
    """``collate_fn`` of a ``ReplayBuffer`` over group stores: a read already returns one TensorDict."""
    return data


def register_default_collate(storage_type: type) -> None:
    """Make :func:`collate_identity` torchrl's default ``collate_fn`` for instances of ``storage_type``."""
    for name in _LOOKUP_MODULES:
        try:
            module: Any = importlib.import_module(name)  # (a torchrl module: its attributes are untyped)
        except ImportError:
            continue
        lookup = getattr(module, "_get_default_collate", None)
        if lookup is None or getattr(lookup, "rbpipe_wrapped", False):
            continue

        def default_collate(storage, *args, _lookup=lookup, **kwargs):
            if isinstance(storage, storage_type):
                return collate_identity
            return _lookup(storage, *args, **kwargs)

        default_collate.rbpipe_wrapped = True  # type: ignore[attr-defined]
        module._get_default_collate = default_collate
