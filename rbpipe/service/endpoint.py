"""How a worker finds and joins a running service: ``RUN_DIR/endpoint.json``, the key, ``--connect``.

``rbpipe serve`` writes ``endpoint.json`` (address, where the key is, store, weights, the run's settings) and
the key in ``RUN_DIR/authkey`` (mode 0600, random per service). ``--connect RUN_DIR`` reads both;
``--connect HOST:PORT`` (a service started with ``--listen HOST:PORT``) takes the key from
``RBPIPE_AUTHKEY`` (hex) or ``--authkey-file`` and the rest from the service itself.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbpipe.errors import ConfigError, RbpipeError
from rbpipe.rundir import AUTHKEY, ENDPOINT
from rbpipe.system.fsutil import atomic_write_json

AUTHKEY_ENV = "RBPIPE_AUTHKEY"
REGISTRY_NAME = "rbpipe"  # the service's registry and coordinator in its manager


def new_authkey(run_dir: Path) -> bytes:
    """A fresh random key, saved where only this user can read it."""
    key = secrets.token_bytes(32)
    path = Path(run_dir) / AUTHKEY
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def write_endpoint(run_dir: Path, endpoint: dict) -> None:
    atomic_write_json(Path(run_dir) / ENDPOINT, endpoint, indent=1)


def parse_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` -> ``(host, port)``; anything else (a run directory) -> None."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or os.path.isdir(text):
        return None
    return host, int(port)


def parse_listen(text: str | None) -> tuple[str, int] | None:
    if text is None:
        return None
    address = parse_address(text)
    if address is None:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:7420 (port 0: any free port)")
    return address


def _read_key(path: Path) -> bytes:
    try:
        text = path.read_text().strip()
        return bytes.fromhex(text)
    except OSError as err:
        raise RbpipeError(f"cannot read the service key {path}: {err.strerror}; run as the user who started "
                          f"`rbpipe serve`, or pass the key in {AUTHKEY_ENV}") from err
    except ValueError as err:
        raise RbpipeError(f"the service key {path} is not hex; copy the file `rbpipe serve` wrote") from err


def authkey_for(target: str, authkey_file: str | None = None) -> bytes:
    """The key to join ``target``: ``--authkey-file``, else ``RBPIPE_AUTHKEY``, else ``RUN_DIR/authkey``."""
    if authkey_file is not None:
        return _read_key(Path(authkey_file))
    env = os.environ.get(AUTHKEY_ENV)
    if env:
        try:
            return bytes.fromhex(env.strip())
        except ValueError as err:
            raise RbpipeError(f"{AUTHKEY_ENV} must be the hex key from RUN_DIR/{AUTHKEY}") from err
    if parse_address(target) is not None:
        raise RbpipeError(f"--connect {target}: no key; set {AUTHKEY_ENV} to the contents of the service's "
                          f"RUN_DIR/{AUTHKEY} (or pass --authkey-file)")
    return _read_key(Path(target) / AUTHKEY)


@dataclass
class Attachment:
    """A worker's handles on a service: the manager connection, the registry and coordinator proxies, and the
    service's description (``endpoint.json``)."""

    manager: Any
    registry: Any
    coordinator: Any
    endpoint: dict
    target: str

    @property
    def run_dir(self) -> Path:
        return Path(self.endpoint["run_dir"])

    @property
    def store(self) -> Path:
        return Path(self.endpoint["store"])

    def config(self):
        from rbpipe.config import RunConfig

        return RunConfig.from_json(self.endpoint["config"])


def attach(target: str | os.PathLike, authkey_file: str | None = None) -> Attachment:
    """Join the service at ``target`` (a run directory, or ``HOST:PORT``); one-line errors when it is not there
    or refuses the key."""
    from multiprocess import AuthenticationError

    from rbpipe.grouping.manager import connect_manager, open_registry
    from rbpipe.service.host import open_coordinator

    target = str(target)
    address: Any = parse_address(target)
    endpoint = None
    if address is None:
        path = Path(target) / ENDPOINT
        if not path.exists():
            raise RbpipeError(f"--connect {target}: no {ENDPOINT} there; start `rbpipe serve --run-dir {target}` "
                              "first (or pass HOST:PORT of a service started with --listen)")
        endpoint = json.loads(path.read_text())
        address = endpoint["address"]
        address = tuple(address) if isinstance(address, list) else address
    if endpoint is not None and endpoint.get("engine") == "ray":
        from rbpipe.service.ray import RayManager  # the service's actors, in its Ray namespace

        manager = RayManager.connect(endpoint["ray"])
        coordinator = open_coordinator(manager, REGISTRY_NAME)
        return Attachment(manager, open_registry(manager, REGISTRY_NAME), coordinator, coordinator.endpoint(),
                          target)
    key = authkey_for(target, authkey_file)
    try:
        manager = connect_manager(address, key)
    except AuthenticationError as err:
        raise RbpipeError(f"the service at {target} refused the key ({err}); use the key of that service: "
                          f"its RUN_DIR/{AUTHKEY}, or {AUTHKEY_ENV}") from err
    coordinator = open_coordinator(manager, REGISTRY_NAME)
    endpoint = coordinator.endpoint()
    registry = open_registry(manager, REGISTRY_NAME)
    return Attachment(manager, registry, coordinator, endpoint, target)
