"""Where the learner's per-step metrics go: ``metrics.jsonl`` and one of torchrl's loggers.

``metrics.jsonl`` stays the machine-readable record (the summary, the plot, the progress bar and the tests read
it); every numeric field of a record is also sent, under the same name, to a torchrl logger (CSV, TensorBoard,
Weights & Biases or MLflow), so the loss's own names (``clip_fraction``, ``train/kl1``, ``mismatch/kl``...)
are the one namespace people see in every tool. W&B and MLflow run offline: files under ``RUN_DIR/logs``,
nothing sent over the network.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

from rbpipe.errors import ConfigError
from rbpipe.rundir import LOGS, METRICS
from rbpipe.system.fsutil import atomic_write

LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
#: record fields that are not per-step scalars
_NOT_SCALARS = {"step"}
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_logger(kind: str) -> None:
    """Refuse an unknown logger, or one whose package is missing, before any process starts (torch-free)."""
    if kind not in LOGGERS:
        raise ConfigError(f"--logger must be one of {', '.join(LOGGERS)}, got {kind!r}")
    package = _PACKAGE.get(kind)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--logger {kind} needs the {package} package: pip install {package} "
                          "(or use --logger csv, which needs nothing)")


def log_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LOGS


def _resumed_tensorboard_logger(exp_name: str, log_dir: str, start_step: int):
    """torchrl's ``TensorboardLogger`` whose writer purges the steps after ``start_step``: a resume trains them
    again, and TensorBoard then shows the new session's values instead of both (``SummaryWriter(purge_step)``)."""
    from torch.utils.tensorboard import SummaryWriter
    from torchrl.record.loggers import TensorboardLogger

    class ResumedTensorboardLogger(TensorboardLogger):
        def _create_experiment(self) -> SummaryWriter:
            return SummaryWriter(log_dir=os.path.join(self.log_dir, self.exp_name), purge_step=start_step + 1)

    return ResumedTensorboardLogger(exp_name, log_dir=log_dir)


def make_logger(kind: str, run_dir: str | os.PathLike, exp_name: str, start_step: int = 0):
    """A torchrl logger writing under ``RUN_DIR/logs/`` (offline for wandb and mlflow). ``start_step``: the
    checkpoint step a resumed run starts from (TensorBoard hides the previous session's later steps)."""
    check_logger(kind)
    root = log_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        from torchrl.record.loggers import CSVLogger

        return CSVLogger(exp_name, log_dir=str(root))
    if kind == "tensorboard":
        if start_step:
            return _resumed_tensorboard_logger(exp_name, str(root), start_step)
        from torchrl.record.loggers import TensorboardLogger

        return TensorboardLogger(exp_name, log_dir=str(root))
    if kind == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network, even from wandb's own threads
        os.environ.setdefault("WANDB_SILENT", "true")
        from torchrl.record.loggers import WandbLogger

        return WandbLogger(exp_name, offline=True, save_dir=str(root), project="rbpipe", log_env_packages=False)
    from torchrl.record.loggers import MLFlowLogger

    return MLFlowLogger(exp_name, tracking_uri=(root / "mlruns").resolve().as_uri())


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The per-step scalars of a metrics record, under their own names (lists and the step itself left out)."""
    return {k: float(v) for k, v in record.items()
            if k not in _NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def truncate_csv_logs(root: Path, step: int) -> None:
    """Drop CSV-logger lines past ``step`` (a resume trains those steps again; each must appear once)."""
    for f in root.rglob("*.csv"):
        lines = f.read_text().splitlines(keepends=True)
        keep = [ln for ln in lines if ln.endswith("\n") and (s := _csv_step(ln)) is not None and s <= step]
        if len(keep) != len(lines):
            atomic_write(f, "".join(keep), fsync=False)


def _csv_step(line: str) -> int | None:
    try:
        return int(line.split(",", 1)[0])
    except ValueError:
        return None


class MetricsSink:
    """Append a learner step's record to ``metrics.jsonl`` and log its scalars with a torchrl logger."""

    def __init__(self, run_dir: str | os.PathLike, kind: str = "csv", *, exp_name: str | None = None,
                 start_step: int = 0) -> None:
        self.run_dir, self.kind = Path(run_dir), kind
        exp_name = exp_name or self.run_dir.resolve().name
        if kind == "csv":
            truncate_csv_logs(log_dir(run_dir) / exp_name, start_step)
        self.logger = make_logger(kind, run_dir, exp_name, start_step)
        self._file = open(self.run_dir / METRICS, "a")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = int(record["step"])
        for name, value in scalars(record).items():
            if math.isfinite(value) or self.kind != "mlflow":  # mlflow refuses NaN
                self.logger.log_scalar(name, value, step=step)

    def close(self) -> None:
        """Flush and close: TensorBoard's writer buffers events, W&B and MLflow keep a run open."""
        self._file.close()
        experiment: Any = getattr(self.logger, "experiment", None)
        if self.kind == "tensorboard":
            experiment.close()
        elif self.kind == "wandb":
            experiment.finish()
        elif self.kind == "mlflow":
            import mlflow

            mlflow.end_run()
        elif self.kind == "csv":
            for f in getattr(experiment, "files", {}).values():
                f.close()

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics records past ``step`` (the checkpoint a resume starts from): the steps after it are
    trained again, and each must appear once in ``metrics.jsonl``. A torn last line goes too."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step and line.endswith("\n"):
            keep.append(line)
    if len(keep) != len(lines):
        atomic_write(path, "".join(keep), fsync=False)
