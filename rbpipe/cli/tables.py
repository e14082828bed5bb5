"""Text tables for ``rbpipe inspect`` and ``rbpipe query``: every value shown, long cells wrapped, none cut.

A group is read as a whole (its advantages only make sense next to each other), so a member list that does
not fit its column continues on the next lines instead of ending in ``~``. Kept apart from the CLI so that
the layout is tested on its own, and torch-free like the rest of the read path.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

#: what ``rbpipe query --help`` says about the two views (a test checks it names every column of a run's store)
VIEWS_HELP = """\
views:
  groups        one row per committed group (evicted ones too: see live), complete at every commit
                seq, group_id, members, commit_time, segment, batch, first_row, bytes, live,
                returns, advantages, collectors, policy_versions, lengths (lists, one value per member,
                in stored order: use list_avg(returns), list_max(...), unnest(...), returns[1])
  trajectories  one row per stored (live) trajectory
                seq, member (position in its group), group_id, and every one-value field of the store:
                for `rbpipe run` stores advantage, collector_id, next_done, next_reward, policy_version;
                and per token field its length: tokens_prompt_len, tokens_response_len,
                log_probs_rollout_len; string fields as their text: finish_reason (stop: ended at EOS
                or a --stop string; length: cut at --max-new-tokens) and, for text tasks,
                text_prompt (template applied) and text_response (decoded, special tokens skipped)
  join them on seq: select g.group_id, t.member, t.next_reward from groups g join trajectories t using (seq)
"""

#: (catalogue column, number format, column width): widths fit an 8-member group on one line in 120 columns
GROUP_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("returns", "{:g}", 18), ("advantages", "{:+.2f}", 47), ("collectors", "{:.0f}", 15),
    ("policy_versions", "{:.0f}", 19))
_ID_W, _N_W = 8, 3


def _number(fmt: str, x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return fmt.format(x)


def _wrap(values: Sequence[str], width: int) -> list[str]:
    """Space-separated values on lines of at most ``width`` characters (a longer single value keeps its line)."""
    return textwrap.wrap(" ".join(values), width=width, break_long_words=False, break_on_hyphens=False) or [""]


def format_groups(groups: list[dict[str, Any]], columns=GROUP_COLUMNS) -> str:
    """One row per group (``group_id``, member count, then its member lists), continuation lines as needed."""
    head = f"{'group_id':>{_ID_W}}  {'n':>{_N_W}}  " + "  ".join(f"{name:<{w}}" for name, _, w in columns)
    out = [head.rstrip()]
    for g in groups:
        cells = [_wrap([_number(fmt, x) for x in (g.get(name) or [])], w) for name, fmt, w in columns]
        for i in range(max(len(c) for c in cells)):
            left = (f"{str(g.get('group_id')):>{_ID_W}}  {g.get('members', 0):>{_N_W}}  " if i == 0
                    else " " * (_ID_W + _N_W + 4))
            row = "  ".join(f"{c[i] if i < len(c) else '':<{w}}" for c, (_, _, w) in zip(cells, columns, strict=True))
            out.append((left + row).rstrip())
    return "\n".join(out)


def format_table(names: list[str], rows: list[list[Any]], max_width: int = 60) -> str:
    """A plain aligned table (``rbpipe query``): numbers right-aligned, cells wider than ``max_width``
    wrapped onto continuation lines, never cut."""
    def text(v: Any) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, float):
            return f"{v:.6g}"
        if isinstance(v, list):
            return "[" + ", ".join(text(x) for x in v) + "]"
        return str(v)

    cells = [[_wrap([text(v)], max_width) if len(text(v)) > max_width else [text(v)] for v in r] for r in rows]
    numeric = [bool(rows) and all(isinstance(r[j], (int, float)) and not isinstance(r[j], bool) or r[j] is None
                                  for r in rows) for j in range(len(names))]
    widths = [max([len(n)] + [len(line) for r in cells for line in r[j]]) for j, n in enumerate(names)]

    def line(parts: list[str]) -> str:
        return "  ".join(p.rjust(w) if num else p.ljust(w)
                         for p, w, num in zip(parts, widths, numeric, strict=True)).rstrip()

    out = [line(names), "  ".join("-" * w for w in widths)]
    for r in cells:
        for i in range(max((len(c) for c in r), default=1)):
            out.append(line([c[i] if i < len(c) else "" for c in r]))
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


#: what ``rbpipe inspect --texts`` shows of each member, when the store has it
TEXT_COLUMNS = ("member", "next_reward", "advantage", "finish_reason", "tokens_response_len", "text_prompt",
                "text_response")


def format_texts(group: dict[str, Any], members: list[dict[str, Any]], width: int = 100) -> str:
    """A group's texts for people: its prompt once (members of a group share it), then each member's reward,
    finish reason and response, wrapped and indented, line breaks kept visible as ``\\n``."""
    def block(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text.replace("\n", "\\n"), width=width, initial_indent=indent, subsequent_indent=indent,
                             drop_whitespace=False, replace_whitespace=False) or [indent]

    out = [f"group {group.get('group_id')} (seq {group.get('seq')}, {len(members)} members)"]
    prompt = next((m.get("text_prompt") for m in members if m.get("text_prompt") is not None), None)
    if prompt is not None:
        out += ["  prompt:"] + block(prompt, "    ")
    for m in members:
        head = [f"member {m.get('member')}"]
        for name, fmt in (("next_reward", "reward {:g}"), ("advantage", "advantage {:+.2f}"),
                          ("finish_reason", "finish_reason {}"), ("tokens_response_len", "{} tokens")):
            if m.get(name) is not None:
                head.append(fmt.format(m[name]))
        out.append("  " + ", ".join(head))
        if m.get("text_response") is not None:
            out += block(m["text_response"], "    ")
    return "\n".join(out)


def query_text(table: Any) -> str:
    """A ``rbpipe query`` result (a ``pyarrow.Table``) aligned for people (long cells wrap onto continuation
    lines)."""
    from rbpipe.storage.query import _rows

    return format_table(table.column_names, _rows(table))
