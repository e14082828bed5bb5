"""``RunConfig``: every knob of ``rbpipe run`` in one validated object (the CLI only fills it in)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rbpipe.demo.policy import PolicyConfig
from rbpipe.errors import ConfigError
from rbpipe.model.task_spec import DEFAULT_TASK, normalize_spec

#: The objective's settings that differ from ``LossConfig``'s. Token-level rollout importance sampling corrects for
#: the learner training on groups a policy one version old sampled: on the demo task the one-process loop fed such
#: groups needed a median 212 steps with it and 222 without (5 seeds; 195 with none lagging), and its slowest seed
#: 231 instead of 300 (``bench/RESULTS.md``).
DEFAULT_LOSS: dict[str, Any] = {"rollout_is": "token"}


@dataclass
class RunConfig:
    # processes
    collectors: int = 2
    grouping: str = "rbpipe"  # "rbpipe" (fast shared MCAdvantage) | "torchrl" (stock, the baseline)
    backend: str = "arrow"  # "arrow" | "zarr"
    # grouping (torchrl MCAdvantage options)
    grpo_size: int = 8
    trajectory_return: str | None = "sum"
    keep_return_bounds: tuple[float, float] | None = None
    candidate_group_size: int | None = None
    selector: str = "balanced"
    # task and rollouts
    task: str = DEFAULT_TASK  # task spec (rbpipe.model.task_spec): every process builds the task from this string
    model: str | None = None  # local Hugging Face model directory; None = the built-in tiny Qwen2 (``demo.policy``)
    # where models run (rbpipe.model.device): the learner and, unless collector_device says otherwise, the collectors
    device: str = "cpu"
    collector_device: str | None = None  # None: --device
    dtype: str = "float32"  # collectors' weights; the learner keeps float32 weights and autocasts to this
    max_new_tokens: int = 1  # the task pays for the first token: longer responses only add gradient noise
    temperature: float = 1.0
    seed: int = 0
    # learner
    steps: int = 600
    groups_per_step: int = 8
    lr: float = 1e-3
    micro_batches: int = 1
    max_policy_lag: int = 4
    max_lead_groups: int | None = None  # collectors' lead over the learner; default two steps' groups (lag ~1)
    samples_per_insert: float = 1.0  # rate limiter (rbpipe.rate_limit): groups resolved per group inserted
    min_groups_to_sample: int | None = None  # rate limiter's minimum size to sample; default groups_per_step
    # learning under staleness (issue 36, rbpipe.sampling.staleness): whole-group work units (one policy version
    # per group), and the order the learner takes complete groups in
    one_version_per_group: bool = False
    sample_order: str = "oldest"  # "oldest" (commit order) | "freshest" (newest policy version first)
    checkpoint_every: int = 10  # learner steps between checkpoints (a resumed or restarted learner starts there)
    target_reward: float | None = 0.9  # stop once the last 10 steps average at least this (None: run all steps)
    loss: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_LOSS))  # LossConfig keyword arguments
    logger: str = "csv"  # torchrl logger of the per-step metrics: csv | tensorboard | wandb | mlflow
    # text tasks and generation that stops (issue 38): prompts from a data file, chat template, stops, rewards
    prompts: str | None = None  # .jsonl/.parquet of prompts (instead of --task), with prompt_key and reward
    prompt_key: str | None = None  # the data file's column holding each row's prompt (a str or chat messages)
    reward: str | None = None  # the data file's reward spec (file.py:fn or module:fn): fn(prompt, response, **row)
    chat_template: bool = True  # text prompts go through the tokenizer's chat template when it has one
    stop: list[str] = field(default_factory=list)  # stop strings, besides the tokenizer's / model's EOS ids
    top_k: int | None = None
    top_p: float | None = None
    reward_timeout: float = 30.0  # seconds one reward call may take; past it the sample is dropped (counted)
    # supervision
    max_restarts: int = 3
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        if self.collectors < 1:
            raise ConfigError(f"--collectors must be at least 1, got {self.collectors}")
        if self.grpo_size < 2:
            raise ConfigError(f"--grpo-size must be at least 2 (advantages are relative to the group), "
                              f"got {self.grpo_size}")
        if self.grouping not in ("rbpipe", "torchrl"):
            raise ConfigError(f"--grouping must be 'rbpipe' or 'torchrl', got {self.grouping!r}")
        if self.backend not in ("arrow", "zarr"):
            raise ConfigError(f"--backend must be 'arrow' or 'zarr', got {self.backend!r}")
        if self.trajectory_return not in (None, "sum", "max", "mean"):
            raise ConfigError(f"--trajectory-return must be sum, max or mean, got {self.trajectory_return!r}")
        if self.keep_return_bounds is not None:
            lo, hi = self.keep_return_bounds
            if not lo < hi:
                raise ConfigError(f"--keep-return-bounds LOW HIGH needs LOW < HIGH, got {lo} {hi}")
            self.keep_return_bounds = (float(lo), float(hi))
        if self.candidate_group_size is not None and self.candidate_group_size < self.grpo_size:
            raise ConfigError(f"--candidate-group-size ({self.candidate_group_size}) must be >= --grpo-size "
                              f"({self.grpo_size})")
        if self.selector not in ("first", "uniform", "balanced"):
            raise ConfigError(f"--selector must be first, uniform or balanced, got {self.selector!r}")
        for name in ("steps", "groups_per_step", "max_new_tokens", "micro_batches", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_policy_lag < 0:
            raise ConfigError(f"--max-policy-lag must be >= 0 (0: train only on groups of the current policy), "
                              f"got {self.max_policy_lag}")
        self.check_rate_limit()
        from rbpipe.sampling.staleness import check_sample_order

        check_sample_order(self.sample_order)
        from rbpipe.tracking.metrics_log import check_logger

        check_logger(self.logger)
        if self.target_reward is not None and not math.isfinite(self.target_reward):
            raise ConfigError(f"--target-reward must be a number (or none), got {self.target_reward}")
        if self.lr < 0:
            raise ConfigError(f"--lr must be >= 0, got {self.lr}")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}")
        from rbpipe.model.device import check_device, check_dtype

        self.device = check_device("--device", self.device)
        if self.collector_device is not None:
            self.collector_device = check_device("--collector-device", self.collector_device)
        self.dtype = check_dtype(self.dtype)
        self.task = normalize_spec(self.task)
        self._check_text_options()
        if self.model is not None:
            self.model = str(Path(self.model).expanduser().resolve())  # a --resume from elsewhere finds it
        if self.model is None and self.task == DEFAULT_TASK and self.max_new_tokens + 7 > self.policy.max_positions:
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens} does not fit the model's "
                              f"{self.policy.max_positions} positions")

    def _check_text_options(self) -> None:
        """``--prompts``/``--prompt-key``/``--reward`` come together, instead of ``--task``; sampling bounds."""
        if self.prompts is not None:
            from rbpipe.model.data_task import SUFFIXES

            path = Path(self.prompts).expanduser().resolve()
            if path.suffix not in SUFFIXES:
                raise ConfigError(f"--prompts {self.prompts}: expected a .jsonl or .parquet file")
            if not path.is_file():
                raise ConfigError(f"--prompts {self.prompts}: no such file")
            self.prompts = str(path)
            if not self.prompt_key:
                raise ConfigError(f"--prompts {self.prompts} needs --prompt-key COL: the column that holds each "
                                  "row's prompt (a str or chat messages)")
            if not self.reward:
                raise ConfigError(f"--prompts {self.prompts} needs --reward SPEC (file.py:fn or module:fn), called "
                                  "as fn(prompt, response, **row) with the row's other columns")
            if self.task != DEFAULT_TASK:
                raise ConfigError("--prompts and --task both name the prompts: pass one of them")
            self.reward = normalize_spec(self.reward, "--reward")
        elif self.prompt_key is not None or self.reward is not None:
            flag = "--prompt-key" if self.prompt_key is not None else "--reward"
            raise ConfigError(f"{flag} applies only with --prompts FILE (a task's own reward() scores its responses)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k must be at least 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not self.reward_timeout > 0:
            raise ConfigError(f"--reward-timeout must be > 0 seconds, got {self.reward_timeout}")
        if any(not s for s in self.stop):
            raise ConfigError("--stop needs a non-empty string")
        self.stop = list(self.stop)

    @property
    def task_label(self) -> str:
        """How errors name the run's prompts: ``--task SPEC`` or ``--prompts FILE``."""
        return f"--prompts {self.prompts}" if self.prompts is not None else f"--task {self.task}"

    def make_task(self):
        """The run's task, built from its spec or data file (each process builds its own)."""
        if self.prompts is not None:
            from rbpipe.model.data_task import DataFileTask

            assert self.prompt_key is not None and self.reward is not None  # (checked at construction)
            return DataFileTask(self.prompts, self.prompt_key, self.reward, seed=self.seed)
        from rbpipe.model.task_spec import load_task

        return load_task(self.task, seed=self.seed)

    def sampling(self, tokenizer=None, model=None):
        """The collectors' :class:`~rbpipe.model.generation.Sampling`: the run's temperature, top-k/p and cap, stopping
        at the tokenizer's and the model's EOS ids and at ``--stop`` strings."""
        from rbpipe.model.generation import Sampling, stop_token_ids

        return Sampling(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                        top_p=self.top_p, stop_ids=stop_token_ids(tokenizer, model), stop_strings=tuple(self.stop))

    def make_model(self):
        """The policy model every process starts from: ``--model PATH`` or the built-in tiny Qwen2 (float32, on
        the CPU; :meth:`collector_model` and :meth:`learner_model` place it)."""
        return self.make_model_and_tokenizer(with_tokenizer=False)[0]

    def make_model_and_tokenizer(self, *, with_tokenizer: bool = True):
        """``(model, tokenizer)`` in float32 on the CPU: the learner's actor needs the model's own tokenizer."""
        from rbpipe.demo.policy import build_model, build_tokenizer, load_pretrained

        if self.model is not None:
            return load_pretrained(self.model, with_tokenizer=with_tokenizer)
        return build_model(self.policy), build_tokenizer() if with_tokenizer else None

    def check_devices(self) -> None:
        """Refuse (one line) a CUDA device this machine's torch cannot use; workers placed elsewhere (Ray) are
        checked where they run."""
        from rbpipe.model.device import check_available

        check_available("--device", self.device)
        if self.collector_device is not None:
            check_available("--collector-device", self.collector_device)

    @property
    def collectors_device(self) -> str:
        """Where collectors sample: ``--collector-device``, else ``--device``."""
        return self.collector_device or self.device

    def collector_model(self):
        """A collector's policy: on its device, in ``--dtype`` (published float32 weights are cast on load)."""
        return self.collector_model_and_tokenizer(with_tokenizer=False)[0]

    def collector_model_and_tokenizer(self, *, with_tokenizer: bool = True):
        """:meth:`collector_model` with the model's tokenizer."""
        from rbpipe.model.device import place

        model, tokenizer = self.make_model_and_tokenizer(with_tokenizer=with_tokenizer)
        return place(model, self.collectors_device, self.dtype), tokenizer

    def learner_model_and_tokenizer(self):
        """The learner's model on ``--device`` with float32 (master) weights, whatever ``--dtype``; its forward
        pass autocasts to ``--dtype`` (:func:`rbpipe.model.device.autocast`)."""
        from rbpipe.model.device import place

        model, tokenizer = self.make_model_and_tokenizer()
        return place(model, self.device, "float32"), tokenizer

    def check_rate_limit(self) -> None:
        """Refuse a lead, minimum size or ratio under which collectors and learner would wait for good.

        ``max_policy_lag`` cannot deadlock the run: groups that turn stale are retired, and retired groups
        move the band on as trained ones do."""
        from rbpipe.rate_limit import check_settings

        if self.max_lead_groups is not None and self.max_lead_groups < self.groups_per_step - 1:
            raise ConfigError(f"--max-lead-groups {self.max_lead_groups} lets collectors run only "
                              f"{self.max_lead_groups + 1} prompt(s) ahead, fewer than the {self.groups_per_step} "
                              f"groups a learner step needs, so the run would wait forever (deadlock); use at "
                              f"least {self.groups_per_step - 1}")
        spi = self.samples_per_insert
        check_settings(spi, spi * (self.lead_groups + 1 - self.min_size_to_sample), self.min_size_to_sample,
                       self.groups_per_step)

    @property
    def min_size_to_sample(self) -> int:
        """Fresh groups the learner waits for before a step (``--min-groups-to-sample``, default one step's)."""
        return self.min_groups_to_sample if self.min_groups_to_sample is not None else self.groups_per_step

    @property
    def lead_groups(self) -> int:
        """How many prompts collectors may run ahead of the learner. By default two steps' groups (fewer when
        ``max_policy_lag`` is below 3): the next step's groups are generated while this one trains, and no more,
        so the learner trains on groups one policy version old: each version of lag costs more steps to the
        demo's target (figures: docs/DESIGN.md, Figures behind code choices)."""
        if self.max_lead_groups is not None:
            return self.max_lead_groups
        return self.groups_per_step * min(2, max(1, self.max_policy_lag - 1))

    def loss_config(self):
        """The learner's :class:`~rbpipe.loss.LossConfig`, with the run's generation budget (``max_new_tokens``):
        the fixed constant that ``seq-mean-token-sum-norm`` divides by."""
        from rbpipe.loss import LossConfig

        return LossConfig(**{"max_new_tokens": self.max_new_tokens, **self.loss})

    def share_of(self, collector_id: int) -> int:
        """How many of each prompt's samples collector ``collector_id`` produces (split as evenly as possible)."""
        base, extra = divmod(self.samples_per_prompt, self.collectors)
        return base + (1 if collector_id < extra else 0)

    @property
    def samples_per_prompt(self) -> int:
        return self.candidate_group_size or self.grpo_size

    def grouping_kwargs(self) -> dict[str, Any]:
        from torchrl.objectives.llm import MCAdvantageSelector

        return dict(
            grpo_size=self.grpo_size,
            trajectory_return=self.trajectory_return,
            keep_return_bounds=self.keep_return_bounds,
            candidate_group_size=self.candidate_group_size,
            candidate_selector=MCAdvantageSelector(self.selector),
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["policy"] = self.policy.to_dict()
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data)
        data["policy"] = PolicyConfig(**data.get("policy", {}))
        if data.get("keep_return_bounds") is not None:
            data["keep_return_bounds"] = tuple(data["keep_return_bounds"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))
