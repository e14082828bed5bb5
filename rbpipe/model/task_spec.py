"""Build a task from a spec string (``path/to/file.py:Name`` or ``package.module:Name``).

The spec, not the task object, travels to every process: each one rebuilds the task itself, so a task
needs no pickling and its prompts stay reproducible by index. Every failure is a one-line
:class:`~rbpipe.errors.ConfigError` that names the spec and says what to fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rbpipe.errors import ConfigError

DEFAULT_TASK = "rbpipe.demo.task:CopyFirstDigitTask"
#: the one task spec that moved: run directories written before the demo's model and task went to
#: ``rbpipe/demo/`` store the default task as ``rbpipe.task:...`` in ``config.json``/``endpoint.json``; every
#: spec goes through :func:`_split`, so such a run resumes (and workers attach to it) under the new name
_RENAMED = {"rbpipe.task:CopyFirstDigitTask": DEFAULT_TASK}
_SHAPE = "SPEC is path/to/file.py:Name or package.module:Name"


@runtime_checkable
class Task(Protocol):
    """What rbpipe needs from a task: token-id prompts, deterministic by index, and a verifiable reward."""

    def prompt(self, index: int) -> torch.Tensor: ...

    def reward(self, prompt: torch.Tensor, response: torch.Tensor) -> float: ...


def _split(spec: str, option: str = "--task") -> tuple[str, str]:
    where, sep, name = _RENAMED.get(str(spec), str(spec)).rpartition(":")
    if not sep or not where or not name.isidentifier():
        example = DEFAULT_TASK if option == "--task" else "rewards.py:exact_match"
        raise ConfigError(f"{option} {spec!r} is not a {option[2:]} spec: {_SHAPE} (e.g. {example})")
    return where, name


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def normalize_spec(spec: str, option: str = "--task") -> str:
    """The spec with a file path made absolute, so that every process (and a later ``--resume`` from another
    directory) finds the same file. Checks only the spec's shape; :func:`load_task` does the rest."""
    where, name = _split(spec, option)
    return f"{Path(where).expanduser().resolve()}:{name}" if _is_file(where) else f"{where}:{name}"


def _load_module(spec: str, where: str, option: str = "--task"):
    if _is_file(where):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{option} {spec}: no such file {path}; pass an existing .py file ({_SHAPE})")
        # one module name per file: loading the same file twice in a process reuses it
        mod_name = f"rbpipe_task_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert loader_spec is not None and loader_spec.loader is not None  # always, for a .py file
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as err:
            sys.modules.pop(mod_name, None)
            raise ConfigError(f"{option} {spec}: importing {path} failed: {_one_line(err)}") from err
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        raise ConfigError(f"{option} {spec}: no module {where!r} ({_one_line(err)}); install it or pass a file "
                          f"path ({_SHAPE})") from err
    except Exception as err:  # noqa: BLE001 - user code: any failure is reported in one line
        raise ConfigError(f"{option} {spec}: importing {where} failed: {_one_line(err)}") from err


def load_callable(spec: str, option: str = "--reward") -> Any:
    """The function named by ``spec`` (``file.py:fn`` or ``module:fn``), e.g. a data file's reward.

    Examples:
        >>> load_callable("math:isclose")(1.0, 1.0)
        True
    """
    where, name = _split(spec, option)
    target = getattr(_load_module(spec, where, option), name, None)
    if not callable(target):
        raise ConfigError(f"{option} {spec}: {where} defines no function {name!r}; check the name after the colon")
    return target


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}" if type(err).__name__ not in text else text


def _build(target: Any, seed: int) -> Any:
    """Call a class or factory, passing ``seed`` when it takes one (the built-in task does)."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    takes_seed = "seed" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return target(seed=seed) if takes_seed else target()


def load_task(spec: str = DEFAULT_TASK, *, seed: int = 0) -> Task:
    """The task named by ``spec``: an object with ``prompt`` and ``reward``, or a class or factory returning
    one (called with ``seed=`` when it accepts it, else with no argument).

    Examples:
        >>> task = load_task("rbpipe.demo.task:CopyFirstDigitTask", seed=0)
        >>> task.prompt(0).dtype
        torch.int64
    """
    where, name = _split(spec)
    module = _load_module(spec, where)
    if not hasattr(module, name):
        raise ConfigError(f"--task {spec}: {where} defines no {name!r}; check the name after the colon")
    target = getattr(module, name)
    task = target
    if isinstance(target, type) or (callable(target) and not isinstance(target, Task)):
        try:
            task = _build(target, seed)
        except Exception as err:  # noqa: BLE001 - user code
            raise ConfigError(f"--task {spec}: calling {name} failed: {_one_line(err)}") from err
    missing = [m for m in ("prompt", "reward") if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(f"--task {spec}: {name} has no {' or '.join(f'{m}()' for m in missing)} method; a task "
                          "needs prompt(index) -> 1-D LongTensor and reward(prompt, response) -> float")
    return task


def check_prompt(task: Task, spec: str, vocab_size: int | None = None, *, index: int = 0, encoder=None,
                 label: str | None = None) -> torch.Tensor:
    """Call ``prompt(index)`` once and check it: a non-empty 1-D integer tensor of ids below ``vocab_size``, or
    (with ``encoder``, a :class:`rbpipe.model.chat.PromptEncoder`) a str or chat messages that encode to such ids."""
    from rbpipe.model.chat import PROMPT_SHAPES, is_text_prompt

    label = label or f"--task {spec}"
    try:
        prompt = task.prompt(index)
    except Exception as err:  # noqa: BLE001 - user code
        raise ConfigError(f"{label}: prompt({index}) failed: {_one_line(err)}") from err
    if encoder is not None and is_text_prompt(prompt):
        prompt = encoder.encode(prompt).ids
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0 \
            or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
        got = (f"a {prompt.dim()}-D {prompt.dtype} tensor of {prompt.numel()} element(s)"
               if isinstance(prompt, torch.Tensor) else f"a {type(prompt).__name__}")
        shapes = PROMPT_SHAPES if encoder is not None else "a non-empty 1-D LongTensor of token ids"
        raise ConfigError(f"{label}: prompt({index}) returned {got}; it must return {shapes} "
                          "(e.g. torch.tensor([2, 5, 3]))")
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0:
        raise ConfigError(f"{label}: prompt({index}) has the negative token id {low}; token ids start at 0")
    if vocab_size is not None and high >= vocab_size:
        raise ConfigError(f"{label}: prompt({index}) has token id {high}, outside the model's vocabulary of "
                          f"{vocab_size}; use the model's tokenizer ids, or pass the --model the task was "
                          "written for")
    return prompt


#: how many of a task's first prompts the launcher encodes and measures before anything starts
PROBE_PROMPTS = 16


def check_task_fits(task: Task, spec: str, model: torch.nn.Module, max_new_tokens: int, *, tokenizer: Any = None,
                    chat_template: bool = True, label: str | None = None, probe: int = PROBE_PROMPTS) -> None:
    """Before anything starts: the task's first prompts are valid token ids of ``model`` (text prompts encoded
    with ``tokenizer`` and its chat template), and each plus ``max_new_tokens`` fits the model's positions (a
    misfit would otherwise fail inside every worker). Later prompts that do not fit are dropped by the
    collectors, counted as ``prompt_too_long``."""
    from rbpipe.model.chat import PromptEncoder
    from rbpipe.model.limits import max_positions, vocab_size

    label = label or f"--task {spec}"
    encoder = PromptEncoder(tokenizer, chat_template=chat_template, task_name=label) if tokenizer is not None else None
    positions = max_positions(model)
    for index in range(max(1, probe)):
        prompt = check_prompt(task, spec, vocab_size(model), index=index, encoder=encoder, label=label)
        if positions is not None and prompt.numel() + max_new_tokens > positions:
            raise ConfigError(f"{label}: prompt({index}) has {prompt.numel()} tokens, plus --max-new-tokens "
                              f"{max_new_tokens} that exceeds the model's {positions} positions; shorten the "
                              "prompts or --max-new-tokens")
