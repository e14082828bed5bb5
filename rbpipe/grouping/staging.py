"""Staging area: where a trajectory's payload waits on disk until its group is complete.

The payload is written once, by the process that produced it; only its handle (a file name) crosses the
manager. Files are written completely before the handle is registered, so a writer killed while staging
leaves at most an unregistered file (never a registered, half-written one).
"""

from __future__ import annotations

import itertools
import os
import pickle
import uuid
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase

from rbpipe.errors import RbpipeError


class StagingError(RbpipeError):
    """A staged trajectory payload cannot be written or read back."""


def encode_td(td: TensorDictBase) -> bytes:
    """TensorDict -> bytes: raw tensor buffers, no torch serialization (10x cheaper than pickling the td)."""
    leaves = []
    for key, value in td.items(True, True):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            leaves.append((key, str(t.dtype)[6:], tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()))
        else:
            leaves.append((key, None, None, value))
    return pickle.dumps((tuple(td.batch_size), leaves), protocol=pickle.HIGHEST_PROTOCOL)


def decode_td(data: bytes) -> TensorDict:
    batch_size, leaves = pickle.loads(data)
    td = TensorDict(batch_size=batch_size)
    for key, dtype, shape, raw in leaves:
        if dtype is None:
            td.set_non_tensor(key, raw)
            continue
        dt = getattr(torch, dtype)
        t = torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape) if raw else torch.empty(shape, dtype=dt)
        td.set(key, t)
    return td


class Staging:
    """Directory of pickled trajectories named by handle; safe for many processes (one file per trajectory)."""

    SUFFIX = ".td"

    def __init__(self, path) -> None:
        self.path = Path(path).resolve()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StagingError(f"cannot create the staging directory {self.path}: {err}. Pass a writable "
                               "staging_dir (e.g. STORE/staging)") from err
        self._prefix = None
        self._counter = itertools.count()

    def __getstate__(self) -> dict:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _new_handle(self) -> str:
        if self._prefix is None or not self._prefix.startswith(f"{os.getpid()}-"):
            self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return f"{self._prefix}-{next(self._counter)}{self.SUFFIX}"

    def put(self, td: TensorDictBase) -> str:
        handle = self._new_handle()
        data = encode_td(td)
        try:
            with open(self.path / handle, "wb") as f:
                f.write(data)
        except OSError as err:
            raise StagingError(f"cannot stage a trajectory in {self.path}: {err}. Free disk space or check "
                               "permissions") from err
        return handle

    def load(self, handle: str) -> TensorDictBase:
        try:
            with open(self.path / handle, "rb") as f:
                return decode_td(f.read())
        except FileNotFoundError as err:
            raise StagingError(f"staged trajectory {handle} is missing from {self.path}: the staging directory "
                               "was cleaned while its group was still pending") from err

    def delete(self, handles) -> None:
        for handle in handles:
            try:
                os.unlink(self.path / handle)
            except FileNotFoundError:
                pass

    def handles(self) -> list[str]:
        return sorted(p.name for p in self.path.glob(f"*{self.SUFFIX}"))
