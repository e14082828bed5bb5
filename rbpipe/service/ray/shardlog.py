"""A registry shard's log on disk: one checksummed JSON line per state-changing call, read back without
unpickling anything (the project's rule: nothing read back from disk is unpickled; a file in the run directory
that someone can write must not run code on replay).

A line is framed as the store's commit log frames its lines (:func:`rbpipe.storage.commitlog.encode`: crc32,
compact JSON, ``\\n``). Records::

    {"op": "open", "name": NAME, "options": VALUE | null, "fingerprint": HEX, "staging": VALUE}
    {"op": "call", "name": NAME, "method": one of LOGGED, "args": [VALUE, ...]}

A ``VALUE`` is JSON with explicit tags for what JSON has not: ``{"$bytes": base64}``, ``{"$tuple": [...]}`` (a
group key that is a tuple comes back a tuple: it hashes the same), ``{"$dict": [[key, value], ...]}``,
``{"$int": decimal}`` (beyond 64 bits, which orjson would read back as a float) and
``{"$selector": [strategy, max_combinations]}`` (torchrl's built-in ``MCAdvantageSelector``). ``options`` is
``null`` when they hold anything else (a user's selector object): they are not written, see
:mod:`rbpipe.service.ray.shards` for how they come back after a restart; ``fingerprint`` identifies them.

Reading: a last line without its ``\\n`` was cut short by a kill (its call never ran): it is ignored, as long
as it looks like the start of a line of ours. Any other line that does not decode (a checksum, JSON or tag
that is wrong: foreign or corrupted content) raises :class:`ShardLogError`, one line naming the file.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

from rbpipe.errors import RbpipeError
from rbpipe.storage.commitlog import decode, encode

#: Registry calls that change a shard's state: written to the shard's log first, replayed after a restart.
LOGGED = ("append", "confirm", "quarantine", "reset_stats", "clear_queues")
_TAGS = ("$int", "$bytes", "$tuple", "$dict", "$selector")
_TORN = re.compile(rb"[0-9a-f]{0,7}|[0-9a-f]{8}(?: (?:\{[^\x00-\x1f]*)?)?")  # the start of one of our lines


class ShardLogError(RbpipeError, ValueError):
    """A shard's log holds a line that is not one of its records (foreign or corrupted content)."""


def _builtin_selector(value) -> list | None:
    """``[strategy, max_combinations]`` of torchrl's own ``MCAdvantageSelector`` (not a subclass, default
    ``in_keys``), else None."""
    from torchrl.objectives.llm import MCAdvantageSelector

    if (type(value) is MCAdvantageSelector and set(vars(value)) == {"strategy", "max_combinations", "in_keys"}
            and value.in_keys == ["return"] and isinstance(value.strategy, str)):
        return [value.strategy, int(value.max_combinations)]
    return None


def encode_value(value) -> Any:
    """``value`` as tagged JSON; TypeError for what has no tag (e.g. a user's selector object)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
        return {"$int": str(int(value))}  # orjson reads a longer int back as a float
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {"$dict": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if type(value).__name__ == "MCAdvantageSelector":
        spec = _builtin_selector(value)
        if spec is not None:
            return {"$selector": spec}
    raise TypeError(f"a shard log records int, float, str, bool, None, bytes, tuples, lists and dicts of them, "
                    f"not {type(value).__module__}.{type(value).__qualname__}")


def decode_value(data) -> Any:
    """The value :func:`encode_value` wrote; ValueError for anything else."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in _TAGS:
        raise ValueError(f"not a tagged value: {str(data)[:80]}")
    (tag, body), = data.items()
    if tag == "$int":
        if not isinstance(body, str):
            raise ValueError("$int takes a decimal string")
        return int(body)
    if tag == "$bytes":
        if not isinstance(body, str):
            raise ValueError("$bytes takes a base64 string")
        return base64.b64decode(body, validate=True)
    if not isinstance(body, list):
        raise ValueError(f"{tag} takes a list")
    if tag == "$tuple":
        return tuple(decode_value(v) for v in body)
    if tag == "$dict":
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
            raise ValueError("$dict takes [key, value] pairs")
        return {decode_value(k): decode_value(v) for k, v in body}
    if len(body) != 2 or body[0] not in ("first", "uniform", "balanced") or type(body[1]) is not int:
        raise ValueError("$selector takes [strategy, max_combinations]")
    from torchrl.objectives.llm import MCAdvantageSelector

    return MCAdvantageSelector(body[0], max_combinations=body[1])


def options_fingerprint(options: dict) -> str:
    """What the options compare by when processes join one registry (``join_problem``), hashed: a restarted
    shard checks that the options re-sent to it are the ones it was opened with."""
    from rbpipe.grouping.registry import _canonical

    return hashlib.sha256(repr(_canonical(options)).encode()).hexdigest()[:32]


def open_record(name: str, options: dict, staging: dict | None) -> bytes:
    """The line of ``open``; the options are left out (``null``) when they hold what has no tag."""
    try:
        encoded = encode_value(dict(options))
    except TypeError:
        encoded = None
    return encode({"op": "open", "name": name, "options": encoded, "fingerprint": options_fingerprint(options),
                   "staging": encode_value(staging)})


def call_record(name: str, method: str, args: tuple) -> bytes:
    return encode({"op": "call", "name": name, "method": method, "args": [encode_value(a) for a in args]})


def _record(line: bytes) -> dict:
    record = decode(line)
    if not isinstance(record, dict):
        raise ValueError("bad checksum or JSON")
    op, name = record.get("op"), record.get("name")
    if not isinstance(name, str):
        raise ValueError("no registry name")
    if op == "open" and set(record) == {"op", "name", "options", "fingerprint", "staging"} \
            and isinstance(record["fingerprint"], str):
        options = None if record["options"] is None else decode_value(record["options"])
        staging = decode_value(record["staging"])
        if not (options is None or isinstance(options, dict)) or not (staging is None or isinstance(staging, dict)):
            raise ValueError("open takes dicts")
        return dict(record, options=options, staging=staging)
    if op == "call" and set(record) == {"op", "name", "method", "args"} and record["method"] in LOGGED \
            and isinstance(record["args"], list):
        return dict(record, args=tuple(decode_value(a) for a in record["args"]))
    raise ValueError("not an open or call record")


def read_log(path: Path) -> tuple[list[dict], int]:
    """The records of the log at ``path`` and the length of its whole lines (a torn last line is not one of
    them); ``([], 0)`` when there is no file. :class:`ShardLogError` for a line that does not decode."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    records, pos = [], 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        try:
            records.append(_record(data[pos:end]))
        except (ValueError, TypeError, RecursionError) as err:
            raise ShardLogError(f"{path}: line {len(records) + 1} (byte {pos}) is not a shard log record "
                                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                                "nothing of it was replayed (a foreign or corrupted file)") from None
        pos = end + 1
    tail = data[pos:]
    if not _TORN.fullmatch(tail):
        raise ShardLogError(f"{path}: its end (byte {pos}, {len(tail)} bytes) is not a shard log record cut short; "
                            "nothing of it was replayed (a foreign or corrupted file)")
    return records, pos
