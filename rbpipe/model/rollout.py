"""A collector's work between taking units and handing them over: encode the prompts, sample responses that stop,
decode them, call the reward, build the trajectories, and drop (with a counted reason) what cannot be scored.

Why a module apart from the collector process: the same steps serve ``rbpipe run``'s collectors, Ray's collector
actors and ``bench/generation.py``, and the failure rules live in one place:

* a prompt longer than the model's positions minus ``--max-new-tokens`` drops its unit's samples
  (``prompt_too_long``); one that is not a valid prompt drops them too (``bad_prompt``);
* a reward that raises, runs past ``--reward-timeout`` or returns no finite number drops that sample
  (``reward_error``, ``reward_timeout``, ``reward_not_a_number``); the first error of each reason is printed once.
  A dropped sample is sampled again (up to :data:`REWARD_RETRIES` more times) so that its group still completes;
  samples still unscored after that are given up (their group stays incomplete).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rbpipe.model.chat import PromptEncoder, is_text_prompt
from rbpipe.model.generation import Response, Sampling, generate
from rbpipe.model.rewards import Failed, call_rewards
from rbpipe.trajectory import make_trajectory

PROMPT_TOO_LONG = "prompt_too_long"
BAD_PROMPT = "bad_prompt"
#: how many more times a sample whose reward failed is sampled again before its group is given up
REWARD_RETRIES = 2


@dataclass
class Batch:
    """What one call of :meth:`Rollouts.run` produced: the trajectories to hand over, the samples dropped
    (``reason -> count``) and those given up per prompt (never handed over: ``CollectorClient.skip``)."""

    trajectories: list = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    given_up: Counter = field(default_factory=Counter)


@dataclass
class _Unit:
    prompt_index: int
    prompt: Any  # what task.prompt returned (a reward gets it back as it was)
    ids: torch.Tensor
    text: str | None
    todo: int


class Rollouts:
    """Turns work units into trajectories for one collector (see the module docstring).

    Examples:
        >>> from rbpipe.config import RunConfig
        >>> cfg = RunConfig(max_new_tokens=2)
        >>> model, tokenizer = cfg.make_model_and_tokenizer()
        >>> r = Rollouts(cfg.make_task(), tokenizer, cfg.sampling(tokenizer, model), max_positions=32)
        >>> batch = r.run(model, [{"prompt": 0, "samples": 3}], collector_id=0, policy_version=0)
        >>> len(batch.trajectories), dict(batch.dropped)
        (3, {})
    """

    def __init__(self, task: Any, tokenizer: Any, sampling: Sampling, *, chat_template: bool = True,
                 max_positions: int | None = None, reward_timeout_s: float = 30.0, task_label: str = "the task",
                 log: Callable[[str], Any] = print, generator: torch.Generator | None = None,
                 record_finish_reason: bool = True) -> None:
        self.task, self.tokenizer, self.sampling = task, tokenizer, sampling
        #: off for a store written before trajectories carried it (its schema has no such column)
        self.record_finish_reason = record_finish_reason
        self.encoder = PromptEncoder(tokenizer, chat_template=chat_template, task_name=task_label)
        self.max_positions = max_positions
        self.reward_timeout_s = float(reward_timeout_s)
        self.log, self.generator = log, generator
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else (sampling.stop_ids[0] if sampling.stop_ids else 0)
        self._reward_at = getattr(task, "reward_at", None)  # a data file's reward also gets the row's columns
        self._told: set[str] = set()

    def _say_once(self, reason: str, message: str) -> None:
        if reason not in self._told:
            self._told.add(reason)
            self.log(f"{reason}: {message} (dropped; each such sample is counted in the summary's "
                     "rejected_reasons, this message is printed once)")

    def _unit(self, index: int, n: int, out: Batch) -> _Unit | None:
        try:
            prompt = self.task.prompt(index)
            encoded = self.encoder.encode(prompt)
        except Exception as err:  # noqa: BLE001 - user code: a bad prompt drops its unit, not the collector
            out.dropped[BAD_PROMPT] += n
            out.given_up[index] += n
            self._say_once(BAD_PROMPT, f"prompt {index}: {' '.join(str(err).split()) or type(err).__name__}")
            return None
        limit = None if self.max_positions is None else self.max_positions - self.sampling.max_new_tokens
        if limit is not None and encoded.ids.numel() > limit:
            out.dropped[PROMPT_TOO_LONG] += n
            out.given_up[index] += n
            self._say_once(PROMPT_TOO_LONG, f"prompt {index} has {encoded.ids.numel()} tokens, more than the "
                                            f"model's {self.max_positions} positions minus --max-new-tokens")
            return None
        return _Unit(index, prompt, encoded.ids, encoded.text, n)

    def run(self, model: torch.nn.Module, units: Sequence[dict], *, collector_id: int,
            policy_version: int) -> Batch:
        """Trajectories for ``units`` (``{"prompt": index, "samples": n}``) sampled from ``model``."""
        out = Batch()
        todo = [u for u in (self._unit(int(d["prompt"]), int(d["samples"]), out) for d in units) if u is not None]
        for _ in range(1 + REWARD_RETRIES):
            todo = [u for u in todo if u.todo > 0]
            if not todo:
                break
            responses = generate(model, [u.ids for u in todo], [u.todo for u in todo], self.sampling,
                                 pad_id=self.pad_id, tokenizer=self.tokenizer, generator=self.generator)
            scored = self._score(todo, responses)
            for unit, rows in zip(todo, scored, strict=True):
                unit.todo = 0
                for response, text, reward in rows:
                    if isinstance(reward, Failed):
                        out.dropped[reward.reason] += 1
                        self._say_once(reward.reason, f"prompt {unit.prompt_index}: {reward.message}")
                        unit.todo += 1
                        continue
                    out.trajectories.append(make_trajectory(
                        group_id=unit.prompt_index, prompt=unit.ids, response=response.tokens,
                        rollout_log_probs=response.log_probs, reward=reward, collector_id=collector_id,
                        policy_version=policy_version,
                        finish_reason=(response.finish_reason if self.record_finish_reason and unit.text is not None
                                       else None),
                        text_prompt=unit.text, text_response=text))
        for unit in todo:
            if unit.todo:
                out.given_up[unit.prompt_index] += unit.todo
        return out

    def _score(self, units: list[_Unit], responses: list[list[Response]]) -> list[list[tuple]]:
        """``(response, text or None, reward or Failed)`` per sample, rewards called with a timeout each."""
        texts: list[list[str | None]] = [[self.encoder.decode(r.tokens) if is_text_prompt(u.prompt) else None
                                          for r in rows] for u, rows in zip(units, responses, strict=True)]
        calls = []
        for unit, rows, row_texts in zip(units, responses, texts, strict=True):
            for response, text in zip(rows, row_texts, strict=True):
                calls.append(self._call(unit, response.tokens if text is None else text))
        rewards = iter(call_rewards(calls, self.reward_timeout_s))
        return [[(r, t, next(rewards)) for r, t in zip(rows, row_texts, strict=True)]
                for rows, row_texts in zip(responses, texts, strict=True)]

    def _call(self, unit: _Unit, response: Any) -> Callable[[], Any]:
        reward_at = self._reward_at
        if reward_at is not None:
            return lambda: reward_at(unit.prompt_index, unit.prompt, response)
        return lambda: self.task.reward(unit.prompt, response)
