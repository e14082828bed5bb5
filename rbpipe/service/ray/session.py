"""Starting or joining Ray for one run, kept on loopback for a private instance (docs/RAY.md, 'Loopback only')."""

from __future__ import annotations

import os
import uuid
from typing import Any

from rbpipe.errors import ConfigError
from rbpipe.service.ray.common import _ray

#: Ray decides the node IP from the machine's interface. Without ``--ray-address`` the engine starts a private
#: instance on loopback: this variable (read by Ray when it is imported) makes the driver, the head and every
#: process Ray starts use 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def use_loopback() -> None:
    """Keep this process and every Ray process it starts on 127.0.0.1: the variable for processes started from
    now on, and Ray's constant in this one if Ray was imported already (torchrl imports it when installed)."""
    import sys

    os.environ[LOOPBACK_ENV] = "0"
    constants: Any = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def init_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)``, keeping this process's own SIGTERM handler.

    In the main thread ``ray.init`` replaces it with one that calls ``sys.exit(15)``: a ``kill PID`` of
    ``rbpipe run``/``serve --engine ray`` then skipped the launcher's clean stop (summary, writer lock, exit
    status 0) and an attached worker's. A process with no handler of its own (a library caller) keeps Ray's,
    which shuts Ray down at exit."""
    import signal
    import threading

    ray = _ray()
    mine = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        ray.init(**kwargs)
    finally:
        if callable(mine):
            signal.signal(signal.SIGTERM, mine)


class RaySession:
    """Ray for one run: joins ``address`` (a running cluster), or starts a private instance bound to loopback
    that :meth:`close` shuts down; inside a process already connected to Ray it uses that connection."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 namespace: str | None = None) -> None:
        self.address, self.num_cpus = address, num_cpus
        self.namespace = namespace or f"rbpipe-{uuid.uuid4().hex[:10]}"
        self._owned = False

    def start(self) -> RaySession:
        if self.address is None:
            use_loopback()
        try:
            ray = _ray()
        except ImportError as err:
            raise ConfigError("--engine ray needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.9')") from err
        if ray.is_initialized():
            self.namespace = ray.get_runtime_context().namespace
            return self
        if self.address is not None:
            init_ray(address=self.address, namespace=self.namespace, logging_level="WARNING")
        else:
            use_loopback()
            init_ray(num_cpus=self.num_cpus, namespace=self.namespace, include_dashboard=False,
                     _node_ip_address="127.0.0.1", logging_level="WARNING")
        self._owned = True
        return self

    def close(self) -> None:
        if self._owned:
            _ray().shutdown()
            self._owned = False
