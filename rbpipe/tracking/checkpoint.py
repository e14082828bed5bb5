"""The learner's checkpoint (``RUN_DIR/checkpoint.pt``): written atomically, read back with nothing but tensors
and plain values unpickled. Here, not in the learner, because the service reads it too (a resume publishes the
checkpoint's policy and version) and must not import the learner for that."""

from __future__ import annotations

from pathlib import Path

import torch

from rbpipe.errors import RbpipeError
from rbpipe.rundir import CHECKPOINT
from rbpipe.system.fsutil import atomic_write


def save_checkpoint(run_dir: Path, state: dict) -> None:
    """Write-then-rename (:func:`rbpipe.system.fsutil.atomic_write`, fsynced): a crash leaves the previous checkpoint
    intact."""
    atomic_write(run_dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))


def load_checkpoint(run_dir: Path) -> dict | None:
    """The run's latest checkpoint (``None`` if there is none yet): tensors, numbers, lists and dicts only
    (``weights_only=True``: nothing else is unpickled). ``--resume`` (the service publishes its policy and
    version) and a learner that attaches to a run with a checkpoint (a resumed run, or a learner actor that
    Ray restarted) both start from it."""
    import pickle

    ckpt = Path(run_dir) / CHECKPOINT
    if not ckpt.exists():
        return None
    try:
        return torch.load(ckpt, weights_only=True)
    except pickle.UnpicklingError as err:  # refused, not executed
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RbpipeError(f"checkpoint {ckpt} holds objects other than tensors and plain values ({first}); "
                          "rbpipe writes only those: move the file away to start this run's learner afresh") from None
