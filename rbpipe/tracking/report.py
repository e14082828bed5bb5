"""Turn a finished run into ``summary.json``, a table for people and a PNG of the learning curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Learner metrics, one JSON object per line; a torn last line (crash mid-write) is skipped."""
    records: list[dict[str, Any]] = []
    if not Path(path).exists():
        return records
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsTail:
    """Follow a growing metrics file without rereading it (the progress bar polls it 4 times a second)."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self.last = Path(path), 0, None

    def poll(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return self.last
        with open(self.path) as f:
            if f.seek(0, 2) < self._offset:  # rewritten shorter (a resume dropped steps past its checkpoint)
                self._offset = 0
            f.seek(self._offset)
            chunk = f.read()
        complete, _, _ = chunk.rpartition("\n")
        if complete:
            self._offset += len(complete) + 1
            try:
                self.last = json.loads(complete.splitlines()[-1])
            except json.JSONDecodeError:
                pass
        return self.last


def first_last_fraction(values: list[float], fraction: float = 0.2) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    k = max(1, int(round(len(values) * fraction)))
    return sum(values[:k]) / k, sum(values[-k:]) / k


#: per-step timing fields summed (or averaged) over a run in ``summary.json``'s ``timing``
SUMMED_TIMING = ("learner/data_wait_s", "learner/sample_s", "learner/train_s", "learner/publish_s",
                 "learner/collectors_rate_limited_s",
                 "collectors/generate_s", "collectors/handover_s")


def timing_summary(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where the run's time went: the learner's seconds waiting for data, reading it, training and publishing, its mean
    busy fraction and policy lag, and the collectors' seconds generating, handing over and rate limited."""
    out: dict[str, float | None] = {}
    for key in SUMMED_TIMING:
        values = [r[key] for r in records if key in r]
        out[key.replace("/", "_")] = round(sum(values), 3) if values else None
    for key in ("learner/busy_fraction", "learner/policy_lag"):
        values = [r[key] for r in records if key in r]
        out[key.replace("/", "_") + "_mean"] = round(sum(values) / len(values), 4) if values else None
    return out


def last_mean(values: list[float], n: int = 10) -> float | None:
    return sum(values[-n:]) / len(values[-n:]) if values else None


def plot_rewards(records: list[dict[str, Any]], out: Path, title: str = "rbpipe run") -> Path | None:
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    window = max(1, len(rewards) // 20)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    timing = [k for k in ("learner/busy_fraction", "learner/policy_lag") if any(k in r for r in records)]
    if timing:  # a second panel: how busy the learner was, and how old the policies of its data were
        fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 6), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
        _plot_timing(low, records)
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, rewards, color="#9ecae1", linewidth=1, label="mean reward of the step's batch")
    ax.plot(steps, smooth, color="#08519c", linewidth=2, label=f"moving average ({window} steps)")
    (low if timing else ax).set_xlabel("learner step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _plot_timing(ax, records: list[dict[str, Any]]) -> None:
    """Learner-busy fraction (left axis) and policy lag in versions (right axis) per step."""
    busy = [(r["step"], r["learner/busy_fraction"]) for r in records if "learner/busy_fraction" in r]
    lag = [(r["step"], r["learner/policy_lag"]) for r in records if "learner/policy_lag" in r]
    lines = []
    if busy:
        lines += ax.plot(*zip(*busy, strict=True), color="#d95f02", linewidth=1,
                         label="learner busy (loss, backward, optimizer)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("busy fraction")
    ax.grid(alpha=0.3)
    if lag:
        right = ax.twinx()
        lines += right.plot(*zip(*lag, strict=True), color="#7570b3", linewidth=1, label="policy lag (versions, mean)")
        right.set_ylabel("policy lag")
        right.set_ylim(bottom=0)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize="small")


def summary_table(summary: dict[str, Any]) -> str:
    """A plain-text two-column table (no terminal features needed, so logs stay readable)."""
    rows = [
        ("trajectories produced", summary.get("produced")),
        ("  rejected (bad input)", summary.get("rejected")),
        ("  written to the store", summary.get("written")),
        ("  dropped (dynamic sampling)", summary.get("dropped")),
        ("  unselected (oversampling)", summary.get("unselected")),
        ("  still queued (incomplete groups)", summary.get("queued")),
        ("conservation holds", summary.get("conservation_ok")),
        ("groups written / dropped", f"{summary.get('groups_written')} / {summary.get('groups_dropped')}"),
        ("group size (grpo_size)", summary.get("grpo_size")),
        ("learner steps", summary.get("learner_steps")),
        ("stale trajectories skipped", summary.get("stale_trajectories")),
        ("mean reward, first 20% of steps", _fmt(summary.get("reward_first20"))),
        ("mean reward, last 20% of steps", _fmt(summary.get("reward_last20"))),
        ("mean reward, last 10 steps", _fmt(summary.get("reward_last10"))),
        ("target reward reached", "-" if summary.get("target_reward") is None
         else f"{summary.get('reached_target')} (target {summary.get('target_reward')})"),
        ("learner busy (mean fraction)", _fmt((summary.get("timing") or {}).get("learner_busy_fraction_mean"))),
        ("collector restarts", summary.get("restarts")),
        ("duration", f"{summary.get('duration_s', 0):.1f} s"),
        ("store", summary.get("store")),
        ("plot", summary.get("plot")),
    ]
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 40 + "+"
    out = [line]
    for key, value in rows:
        out.append(f"| {key:<{width}} | {str(value):<38} |")
    out.append(line)
    return "\n".join(out)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
