"""What a run directory holds, by name, and the order a resumed run reads its states back.

Every file and folder that ``rbpipe run``/``serve`` writes under ``RUN_DIR`` is named here once, so the modules
that write one and those that read it (the service, the learner, the launcher, the viewer, ``inspect``) agree
without importing each other. The names are a contract (README.md, docs/ARCHITECTURE.md's table of files):
change none of them. This module imports nothing, so every process, torch-free tools included, can use it.
"""

from __future__ import annotations

#: the run's settings as given (``--resume`` reads them back)
CONFIG = "config.json"
#: ``{"store": PATH}``: where the run's store is (``--store`` may put it outside the run directory)
RUN = "run.json"
#: the store's folder when ``--store`` is not given
STORE = "store"
#: inside the store: trajectories handed to the grouping but not yet in a committed group (requeued on resume)
STAGING = "staging"
#: how a worker finds the service, and the key it authenticates with (mode 0600)
ENDPOINT = "endpoint.json"
AUTHKEY = "authkey"
#: the coordinator's work units and counters (rewritten whole; ``prompts.json.journal`` holds the changes since)
PROMPTS = "prompts.json"
#: the rate limiter's band, shared by the service and the learner
RATE_LIMIT = "rate_limit.bin"
#: the learner's latest weights, optimizer and step (torch, ``weights_only``)
CHECKPOINT = "checkpoint.pt"
#: one JSON line per learner step
METRICS = "metrics.jsonl"
#: torchrl loggers' files (CSV, TensorBoard, offline W&B/MLflow)
LOGS = "logs"
#: ``<role>-<pid>.json``: each process's peak resident memory
MEMORY = "memory"
#: the finished run's figures, and its learning curve
SUMMARY = "summary.json"
PLOT = "reward.png"
#: ``{name: pid}`` of the run's processes, and their start times (a live process told from a recycled pid)
PIDS = "pids.json"
PID_STARTS = "pid_starts.json"
#: ``--engine ray``: the namespace and where each worker actor was placed
RAY_WORKERS = "ray_workers.json"
#: ``--engine ray``: a service's registry shards log under ``<8 hex digits>-shards/shard-<index>.log``
SHARD_LOGS = "{prefix}shards"
SHARD_LOG = "shard-{index}.log"
#: In the shards' log directory: what the coordinator actor was configured with (plain JSON), so that a
#: coordinator Ray restarts configures itself again (its state comes from ``prompts.json``).
COORDINATOR_SETTINGS = "coordinator.json"

#: What a resumed run (``rbpipe run --resume``, ``rbpipe serve`` on a run directory) reads back, in this order,
#: and why the order. Each entry: (the state, where it is, what reading it does).
RESUME_ORDER = (
    ("commit log", f"{STORE}/commits.jsonl", "opening the store: the committed groups, a torn tail cut off; "
     "everything later is checked against it"),
    ("checkpoint", CHECKPOINT, "validated before anything starts (a bad file is refused, nothing written)"),
    ("shard logs", SHARD_LOGS, "--engine ray: a killed session's are removed, not replayed (the staging area "
     "below holds what they held); a live session replays them only when Ray restarts a shard (and reads "
     f"{COORDINATOR_SETTINGS} there when Ray restarts its coordinator)"),
    ("staging", f"{STORE}/{STAGING}", "trajectories not yet in a committed group are queued again, torn files "
     "set aside"),
    ("prompts journal", f"{PROMPTS} + {PROMPTS}.journal", "the coordinator's units, reconciled with what the "
     "staging area held so that no unit is owed twice (its \"live\" entry is read only by a coordinator Ray "
     "restarts within the same session)"),
    ("checkpoint", CHECKPOINT, "the policy and its version are published to collectors; metrics past its "
     f"step are dropped from {METRICS} (those steps are trained again)"),
)
