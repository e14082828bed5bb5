"""What torchrl's LLM stack writes, as rows an rbpipe store keeps, and back.

``LLMCollector`` hands a buffer a lazy stack of steps whose leaves are torchrl tensorclasses (``Text``,
``Tokens``, ``LogProbs``, ``Masks``, ``ChatHistory`` holding ``History`` objects) around ragged tensors and
strings. rbpipe stages and stores tensors and ``str`` leaves only (it never pickles data), so each step is
encoded before it is handed over:

- a tensorclass becomes a plain sub-TensorDict with the same field names (``None`` fields and the
  ``padded`` metadata flag are left out: they describe no data);
- a ``History`` (a conversation: role/content/is_complete per message, a different count per step) becomes
  one JSON ``str`` leaf at the same key;
- tensors and ``str`` leaves stay as they are; anything else is refused in one line (before anything is
  queued), naming the key.

:func:`decode` rebuilds the tensorclasses (by torchrl's field names: ``text``, ``tokens``, ``log_probs``,
``masks``, ``history``, at any depth) and the ``History`` objects, so that ``batch["next", "history"].prompt``
and ``batch.get(("tokens", "full"), as_padded_tensor=True)`` work on what ``sample`` returns as they do on
torchrl's ``LazyStackStorage``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from rbpipe.errors import BadTrajectoryError

#: the tensorclass each of torchrl's LLM field names holds (``torchrl.modules.llm.policies.common``)
_CLASS_NAMES = {"text": "Text", "tokens": "Tokens", "log_probs": "LogProbs", "masks": "Masks",
                "history": "ChatHistory"}
_SKIPPED_FIELDS = ("padded",)  # a flag about how the wrapper laid tensors out, not data


def _classes() -> dict[str, Any]:
    from torchrl.modules.llm.policies import common

    return {name: getattr(common, cls) for name, cls in _CLASS_NAMES.items()}


def _history_type() -> Any:
    from torchrl.data.llm import History

    return History


def _key_name(path: tuple) -> str:
    return ".".join(map(str, path))


def _encode_value(value: Any, path: tuple, history: Any) -> Any:
    """One leaf or sub-structure of a step -> tensor, str, dict (a sub-TensorDict), or None (left out)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, history):
        return json.dumps(value.tolist(), ensure_ascii=False)
    if isinstance(value, NonTensorData):
        value = value.data
    if isinstance(value, str) or value is None:
        return value
    if is_tensorclass(value) or isinstance(value, TensorDictBase):
        return _encode_fields(value if isinstance(value, TensorDictBase) else value._tensordict, path, history)
    raise BadTrajectoryError(f"leaf {_key_name(path)!r} holds {type(value).__name__}: the rbpipe buffer stores "
                             "tensors, str and torchrl's LLM tensorclasses (Text, Tokens, LogProbs, Masks, "
                             "ChatHistory); convert it to a tensor or a str, or exclude it before extend()")


def _encode_fields(step: TensorDictBase, path: tuple, history: Any) -> dict:
    out = {}
    skip = _SKIPPED_FIELDS if path and path[-1] in _CLASS_NAMES else ()
    for name in step.keys():
        if name in skip:
            continue
        value = _encode_value(step.get(name), (*path, name), history)
        if value is not None:
            out[name] = value
    return out


def encode(data: TensorDictBase) -> TensorDictBase:
    """``data`` (``[N]`` steps as ``LLMCollector`` writes them, or one ``[]`` step) as plain rows. Each row is
    built as one dict and made a TensorDict once (``str`` leaves become ``NonTensorData`` there): setting the
    leaves one by one cost several times more."""
    if not isinstance(data, TensorDictBase):
        raise BadTrajectoryError(f"extend() takes a TensorDict of trajectories, got {type(data).__name__}")
    history = _history_type()
    if data.ndim == 0:
        return TensorDict(_encode_fields(data, (), history), batch_size=data.batch_size)
    if data.ndim != 1:
        data = data.reshape(-1)  # [envs, steps]: one row per step, as torchrl's flattened collector output
    return lazy_stack([TensorDict(_encode_fields(step, (), history), batch_size=step.batch_size)
                       for step in data.unbind(0)])


def _decode_step(step: TensorDictBase, classes: dict[str, Any], history: Any) -> TensorDictBase:
    for name in list(step.keys()):
        value = step.get(name)
        if name == "next" and isinstance(value, TensorDictBase):
            step.set(name, _decode_step(value, classes, history))
        elif name in classes and isinstance(value, TensorDictBase):
            if name == "history":
                for field in list(value.keys()):
                    text = value.get(field)
                    if isinstance(text, NonTensorData):
                        text = text.data
                    if isinstance(text, str):
                        value.set(field, history.from_chats(json.loads(text)), inplace=False)
            step.set(name, classes[name].from_tensordict(value))
    return step


def decode(data: TensorDictBase) -> TensorDictBase:
    """Rows read back from the store -> torchrl's LLM layout (tensorclasses and ``History`` rebuilt)."""
    classes, history = _classes(), _history_type()
    if data.ndim == 0:
        return _decode_step(data, classes, history)
    if not isinstance(data, LazyStackedTensorDict):
        return data  # a dense read (no ragged or structured field): nothing to rebuild
    return lazy_stack([_decode_step(step, classes, history) for step in data.unbind(0)])
