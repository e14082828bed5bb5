"""Errors that rbpipe raises on purpose: each says what is wrong and how to fix it."""

from __future__ import annotations


class RbpipeError(Exception):
    """Base class: an error whose message is meant to be read by a person, not a traceback."""


class BadTrajectoryError(RbpipeError, ValueError):
    """A trajectory handed to the buffer is malformed; it was rejected and nothing was stored."""


class SchemaError(RbpipeError, ValueError):
    """Data does not match the schema the store was created with (new key, new dtype or shape)."""


class StoreError(RbpipeError):
    """A store cannot be opened or written (not a store, incompatible version, locked, read-only)."""


class StaleReadError(StoreError):
    """Rows drawn against an earlier view of the store belong to groups that were evicted (and their data
    deleted) since: nothing was returned. Refresh (``len(storage)``) and draw again."""


class StoreLockedError(StoreError):
    """Another live process holds the store's writer lock."""


class ManagerDiedError(RbpipeError, RuntimeError):
    """The shared-state manager process is gone; workers stop instead of hanging on a proxy."""


class ConfigError(RbpipeError, ValueError):
    """An impossible or inconsistent configuration."""


class NotAGroupError(SchemaError, TypeError):
    """What was handed to a store is not a group (a TensorDict with one batch dimension)."""
