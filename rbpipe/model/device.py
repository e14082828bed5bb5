"""Where models run and in what precision: ``--device``, ``--collector-device`` and ``--dtype``.

One rule for every process: weights travel as float32 (``rbpipe.service.weights``, one copy per version), each process
casts them to its own device and dtype. The learner keeps float32 master weights whatever ``--dtype`` says and
runs its forward pass under ``torch.autocast`` in bfloat16: Adam steps of ``lr * 1e-5``-sized updates on
bfloat16 weights mostly round to nothing (a bfloat16 value has 8 significant bits), and the loss takes its
log-probs, ratios and entropies in float32 (:mod:`rbpipe.loss.logprobs`).
"""

from __future__ import annotations

import contextlib

import torch

from rbpipe.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_device(option: str, value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (normalised), else a one-line :class:`ConfigError` naming ``option``."""
    text = str(value).strip().lower()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ConfigError(f"{option} {value!r}: expected cpu, cuda or cuda:N (N = a GPU index)")
    return str(device)


def check_dtype(value: str) -> str:
    if value not in DTYPES:
        raise ConfigError(f"--dtype {value!r}: expected one of {', '.join(DTYPES)}")
    return value


def check_available(option: str, device: str) -> None:
    """Refuse a CUDA device this machine's torch cannot use, before anything starts (one line)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{option} {device}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                          "torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{option} {device}: this machine has {torch.cuda.device_count()} GPU(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def autocast(device: str, dtype: str) -> contextlib.AbstractContextManager:
    """The learner's compute precision: bfloat16 autocast over float32 weights, or nothing for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


def place(model: torch.nn.Module, device: str, dtype: str = "float32") -> torch.nn.Module:
    """``model`` moved to ``device`` in ``dtype`` (in place, returned for chaining)."""
    return model.to(device=torch.device(device), dtype=DTYPES[dtype])
