"""Publish the learner's weights to collectors through a memory-mapped file and a version counter.

``torch.from_file(..., shared=True)`` maps the same pages in every reader, so publishing is one write of the
vector and needs no pickling and no process-library primitive (stdlib and ``multiprocess`` alike see a path).
A seqlock (counter odd while writing) lets readers detect and retry a torn copy without a lock that a
killed learner could leave held.

The learner writes the vector through the file (``os.pwrite``, one parameter at a time), not through its
mapping: pages it touched in a mapping would count in its resident memory for the rest of the run (the whole
vector: hundreds of MB for a small real model; figures: docs/DESIGN.md, Figures behind code choices), and one
``torch.cat`` of every parameter would add as much again at each publish; the readers' mappings see the same pages.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from rbpipe.demo.policy import load_flat_parameters
from rbpipe.system.procs import shared_memory_dir, sweep_dead_files

_SEQ, _VERSION, _STEP, _NUMEL = 0, 1, 2, 3
_HEADER = 8
WEIGHTS_PREFIX = "rbpipe-weights-"  # + "<launcher pid>-<random>": files of dead pids are swept


def default_weights_dir(run_dir: Path) -> Path:
    """Prefer RAM-backed /dev/shm (where weight files of killed launchers are removed first); fall back to the
    run directory."""
    shm = shared_memory_dir()
    if shm is None:
        return run_dir
    sweep_dead_files(shm, WEIGHTS_PREFIX)
    return Path(shm)


class SharedWeights:
    """A flat float32 parameter vector plus ``(seq, version, learner_step)`` header shared by path."""

    def __init__(self, path: str | Path, numel: int, *, create: bool = False) -> None:
        self.path = Path(path)
        self.numel = int(numel)
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for p in (self.path, self._header_path):
                p.unlink(missing_ok=True)
        self._open()
        if create:
            self._header[_NUMEL] = self.numel

    @property
    def _header_path(self) -> Path:
        return self.path.with_name(self.path.name + ".hdr")

    def _open(self) -> None:
        self._flat = torch.from_file(str(self.path), shared=True, size=self.numel, dtype=torch.float32)
        self._header = torch.from_file(str(self._header_path), shared=True, size=_HEADER, dtype=torch.int64)

    def __getstate__(self) -> dict:
        return {"path": str(self.path), "numel": self.numel}

    def __setstate__(self, state: dict) -> None:
        self.path, self.numel = Path(state["path"]), state["numel"]
        self._open()

    @property
    def version(self) -> int:
        return int(self._header[_VERSION])

    @property
    def learner_step(self) -> int:
        return int(self._header[_STEP])

    def publish(self, model: torch.nn.Module, *, version: int, learner_step: int | None = None) -> None:
        count = sum(p.numel() for p in model.parameters())
        if count != self.numel:  # before the header says "writing": readers never wait on a publish that failed
            raise ValueError(f"the model has {count} parameters; {self.path} holds {self.numel}")
        self._header[_SEQ] += 1  # odd: writing
        write_parameters(self.path, model)
        self._header[_VERSION] = version
        if learner_step is not None:
            self._header[_STEP] = learner_step
        self._header[_SEQ] += 1  # even: consistent

    def load_into(self, model: torch.nn.Module, *, timeout: float = 10.0) -> int:
        """Copy the latest consistent weights into ``model``; return their version."""
        deadline = time.monotonic() + timeout
        while True:
            seq = int(self._header[_SEQ])
            if seq % 2 == 0:
                snapshot = self._flat.clone()
                version = int(self._header[_VERSION])
                if int(self._header[_SEQ]) == seq:
                    load_flat_parameters(model, snapshot)
                    return version
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read a consistent weight snapshot from {self.path}")
            time.sleep(0.001)

    def unlink(self) -> None:
        for p in (self.path, self._header_path):
            p.unlink(missing_ok=True)


def write_parameters(path: Path, model: torch.nn.Module) -> None:
    """Write ``model``'s parameters as one float32 vector into the file at ``path``, one parameter at a time
    (a temporary copy only for a parameter on another device or in another dtype)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        offset = 0
        for p in model.parameters():
            values = p.detach().reshape(-1).to("cpu", torch.float32).numpy()
            view, at = values.data.cast("B"), offset * 4
            while view:  # pwrite may write less than asked (a signal); the rest follows
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
            offset += values.size
    finally:
        os.close(fd)
