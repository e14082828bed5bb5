"""The fraction of responses cut at ``--max-new-tokens``: a per-step metric, and a warning when most are.

Why it matters enough for a warning: a response cut at the cap is scored on a fragment (a sum cut mid-number),
and a policy trained on such groups learns the fragment; nothing else in a run's output says it happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rbpipe.model.generation import LENGTH
from rbpipe.trajectory import FINISH_REASON_KEY

#: above this fraction of a step's responses cut at the cap, the learner warns (once per run)
WARN_ABOVE = 0.5


def finish_reasons(rows: Any) -> list[str] | None:
    """The ``finish_reason`` of each row of a sampled batch, or None when the rows have none (an older store)."""
    try:
        value = rows.get(FINISH_REASON_KEY, None)
    except (KeyError, RuntimeError):
        return None
    if value is None:
        return None
    if isinstance(value, str):
        return [value] * len(rows)
    data = value.tolist() if hasattr(value, "tolist") else getattr(value, "data", value)
    if isinstance(data, str):
        return [data] * len(rows)
    flat: list[str] = []
    stack = [data]
    while stack:  # rows of [1] steps read back as nested lists
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            flat.append(str(item))
    return flat


def truncated_fraction(rows: Any) -> float | None:
    """The fraction of ``rows`` whose response was cut at the cap (``finish_reason == "length"``)."""
    reasons = finish_reasons(rows)
    if not reasons:
        return None
    return sum(r == LENGTH for r in reasons) / len(reasons)


def warn_truncated(fraction: float | None, max_new_tokens: int, warned: bool, log: Callable[[str], Any]) -> bool:
    """Log one warning the first time most of a step's responses hit the cap; returns whether it was given."""
    if warned or fraction is None or fraction <= WARN_ABOVE:
        return warned
    log(f"warning: {fraction:.0%} of this step's responses were cut at --max-new-tokens {max_new_tokens} "
        "(finish_reason 'length', metric truncated_fraction): their rewards score unfinished answers; raise "
        "--max-new-tokens, or add a --stop string")
    return True
