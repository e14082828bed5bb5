"""Prompts from a data file (``--prompts FILE.jsonl|.parquet --prompt-key COL --reward SPEC``), as the peers take
datasets: the reward is called as ``fn(prompt, response, **row)`` with the row's other columns (e.g. ``answer``).

Why the rows are shuffled per epoch from the seed, not read in file order: every process rebuilds the task from
the same three settings, so ``prompt(i)`` must depend only on ``i`` and the seed, and a file sorted by difficulty
or source must not feed the learner one kind of prompt for hundreds of steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rbpipe.errors import ConfigError

SUFFIXES = (".jsonl", ".parquet")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The file's rows as dicts (JSON Lines: one object a line; Parquet: through pyarrow); one-line errors."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"--prompts {path}: expected a .jsonl or .parquet file")
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for an unreadable file
            raise ConfigError(f"--prompts {path}: not a readable Parquet file ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]})") from err
    else:
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"--prompts {path}: line {number} is not JSON ({err.msg}); write one JSON "
                                  "object per line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"--prompts {path}: line {number} is a {type(row).__name__}, not a JSON object")
            rows.append(row)
    if not rows:
        raise ConfigError(f"--prompts {path}: the file has no rows")
    return rows


class DataFileTask:
    """A task over a data file's rows: ``prompt(i)`` is the ``prompt_key`` column of row ``order[i]`` (a new
    seeded permutation every pass over the file), :meth:`reward_at` calls ``reward(prompt, response, **row)``
    with the row's other columns.

    Examples:
        >>> import tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "p.jsonl"
        >>> _ = f.write_text('{"q": "What is 1 + 1?", "answer": 2}\\n')
        >>> task = DataFileTask(f, "q", "rbpipe.demo.arithmetic:exact_answer")
        >>> task.prompt(0), task.reward_at(0, task.prompt(0), "2")
        ('What is 1 + 1?', 1.0)
    """

    def __init__(self, path: str | Path, prompt_key: str, reward: str, seed: int = 0) -> None:
        from rbpipe.model.task_spec import load_callable

        self.path, self.prompt_key, self.seed = Path(path), prompt_key, int(seed)
        self.rows = read_rows(self.path)
        missing = [i for i, row in enumerate(self.rows) if prompt_key not in row]
        if missing:
            raise ConfigError(f"--prompt-key {prompt_key!r}: row {missing[0]} of {self.path} has no such column "
                              f"(it has: {', '.join(sorted(self.rows[missing[0]]))}); pass one of those")
        self.reward_fn = load_callable(reward, "--reward")
        self._orders: dict[int, list[int]] = {}

    def row(self, index: int) -> dict[str, Any]:
        epoch, k = divmod(int(index), len(self.rows))
        order = self._orders.get(epoch)
        if order is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = self._orders[epoch] = torch.randperm(len(self.rows), generator=gen).tolist()
        return self.rows[order[k]]

    def prompt(self, index: int) -> Any:
        return self.row(index)[self.prompt_key]

    def reward_at(self, index: int, prompt: Any, response: str) -> float:
        """The reward of ``response`` to prompt ``index``: ``fn(prompt, response, **other columns)``."""
        others = {k: v for k, v in self.row(index).items() if k != self.prompt_key}
        return float(self.reward_fn(prompt, response, **others))

    def reward(self, prompt: Any, response: str) -> float:
        """The reward of a response to the row whose prompt this is (the first such row): for callers that do
        not know the index; rbpipe's collectors call :meth:`reward_at`."""
        for row in self.rows:
            if row[self.prompt_key] == prompt:
                others = {k: v for k, v in row.items() if k != self.prompt_key}
                return float(self.reward_fn(prompt, response, **others))
        raise KeyError(f"no row of {self.path} has this prompt")
