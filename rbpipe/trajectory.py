"""The trajectory layout shared by collectors, grouping, storage and learner.

One trajectory is one LLM turn: a ``TensorDict`` with ``batch_size=[1]`` (one step, done at the end,
as torchrl's ``MCAdvantage`` expects). Prompt and response lengths vary between trajectories, so the
token fields are *ragged across rows*; storages keep them without padding.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from rbpipe.errors import BadTrajectoryError

GROUP_KEY = "group_id"
REWARD_KEY = ("next", "reward")
DONE_KEY = ("next", "done")
ADVANTAGE_KEY = "advantage"
PROMPT_TOKENS_KEY = ("tokens", "prompt")
RESPONSE_TOKENS_KEY = ("tokens", "response")
ROLLOUT_LOG_PROBS_KEY = ("log_probs", "rollout")
COLLECTOR_KEY = "collector_id"
VERSION_KEY = "policy_version"
#: why the response ended: ``"stop"`` (its last token is a stop token, or it completed a stop string) or
#: ``"length"`` (cut at ``--max-new-tokens``); a ``str`` leaf, stored as a string column
FINISH_REASON_KEY = "finish_reason"
#: a text task's prompt as the model saw it (chat template applied) and its decoded response, beside the token
#: ids, as torchrl's ``Text`` keeps them (``("text", "prompt")``, ``("text", "response")``)
TEXT_PROMPT_KEY = ("text", "prompt")
TEXT_RESPONSE_KEY = ("text", "response")

#: Fields whose trailing shape differs between trajectories.
RAGGED_KEYS = (PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY, ROLLOUT_LOG_PROBS_KEY)
#: Fields every trajectory must carry before it may enter the buffer.
REQUIRED_KEYS = (GROUP_KEY, REWARD_KEY, DONE_KEY, PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY,
                 ROLLOUT_LOG_PROBS_KEY, COLLECTOR_KEY, VERSION_KEY)


def make_trajectory(
    *,
    group_id: int,
    prompt: torch.Tensor,
    response: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    reward: float,
    collector_id: int,
    policy_version: int,
    finish_reason: str | None = None,
    text_prompt: str | None = None,
    text_response: str | None = None,
) -> TensorDict:
    """Build one finished trajectory in the layout above (``finish_reason`` and the texts only when given: a
    token-level task's trajectories carry no text).

    Every leaf is ``[1, ...]`` by construction, so the TensorDicts skip the constructor's checks: a collector
    builds one per sample, and the checked constructor cost most of each (figures: docs/DESIGN.md, Figures behind code
    choices)."""
    one = torch.Size([1])

    def td(fields: dict) -> TensorDict:
        return TensorDict._new_unsafe(fields, batch_size=one)

    traj = td({
        GROUP_KEY: torch.tensor([group_id], dtype=torch.int64),
        "tokens": td({"prompt": prompt.reshape(1, -1).to(torch.int64),
                      "response": response.reshape(1, -1).to(torch.int64)}),
        "log_probs": td({"rollout": rollout_log_probs.reshape(1, -1).to(torch.float32)}),
        "next": td({"reward": torch.tensor([[reward]], dtype=torch.float32),
                    "done": torch.ones(1, 1, dtype=torch.bool)}),
        COLLECTOR_KEY: torch.tensor([collector_id], dtype=torch.int64),
        VERSION_KEY: torch.tensor([policy_version], dtype=torch.int64),
    })
    if finish_reason is not None:
        traj.set_non_tensor(FINISH_REASON_KEY, finish_reason)
    if text_prompt is not None or text_response is not None:
        traj.set_non_tensor(TEXT_PROMPT_KEY, text_prompt or "")
        traj.set_non_tensor(TEXT_RESPONSE_KEY, text_response or "")
    return traj


def _key_name(key) -> str:
    return ".".join(key) if isinstance(key, tuple) else str(key)


def validate_trajectory(td: TensorDictBase, *, required=REQUIRED_KEYS,
                        reward_key=REWARD_KEY, done_key=DONE_KEY) -> None:
    """Reject a malformed trajectory *before* it touches shared state.

    Raises :class:`BadTrajectoryError` naming the problem and the fix. Nothing is queued or stored.
    """
    if not isinstance(td, TensorDictBase):
        raise BadTrajectoryError(
            f"expected a TensorDict trajectory, got {type(td).__name__}; build it with "
            "rbpipe.trajectory.make_trajectory(...)"
        )
    missing = [k for k in required if not _present(td, k)]  # a lookup each: no walk of every key
    if missing:
        present = set(td.keys(True, True))
        names = ", ".join(_key_name(k) for k in missing)
        have = ", ".join(sorted(_key_name(k) for k in present))
        raise BadTrajectoryError(
            f"trajectory is missing required key(s) {names} (it has: {have}). "
            "Check the spelling, or set the key names with the grouping options."
        )
    if td.ndim != 1 or td.shape[0] < 1:
        raise BadTrajectoryError(
            f"a trajectory must have batch_size=[T] with T >= 1 steps, got {tuple(td.shape)}"
        )
    done = leaf_steps(td, done_key)
    done_np = numpy_view(done)
    if not (bool(done_np[-1].all()) if done_np is not None else bool(done[-1].all())):
        raise BadTrajectoryError(
            "trajectory is unfinished: its last step is not done "
            f"({_key_name(done_key)}[-1] is False). Only hand over trajectories that ended; "
            "set done=True on the last step."
        )
    reward = leaf_steps(td, reward_key)
    if isinstance(reward, list):  # per-token rewards of varying length (torchrl's lazy-stacked LLM steps)
        reward = _flat_steps(reward, reward_key)
    if not torch.is_floating_point(reward):
        raise BadTrajectoryError(
            f"reward {_key_name(reward_key)} has dtype {reward.dtype}; rewards must be floating "
            "point (cast with .float())."
        )
    reward_np = numpy_view(reward)
    if not (bool(np.isfinite(reward_np).all()) if reward_np is not None else bool(torch.isfinite(reward).all())):
        bad = reward[~torch.isfinite(reward)].flatten()[:3].tolist()
        raise BadTrajectoryError(
            f"reward {_key_name(reward_key)} is not finite ({', '.join(map(str, bad))}): a NaN or "
            "inf reward would turn every advantage of its group into NaN. Fix the reward function "
            "(or replace non-finite rewards by a number) before handing the trajectory over."
        )


def _present(td: TensorDictBase, key) -> bool:
    try:
        return td.get(key, None) is not None
    except RuntimeError:  # a leaf of a lazy stack whose steps differ in shape: present, just not stackable
        return True


def leaf_steps(td: TensorDictBase, key) -> torch.Tensor | list[torch.Tensor]:
    """``td``'s leaf ``key``: one tensor, or one tensor per step when the steps of a lazy stack hold it with
    different shapes (torchrl's LLM layout: per-token rewards of each step's length)."""
    try:
        return td.get(key)
    except RuntimeError:
        if not isinstance(td, LazyStackedTensorDict):
            raise
        return [row.get(key) for row in td.unbind(0)]


def _flat_steps(parts: list, key) -> torch.Tensor:
    """Per-step tensors -> one flat tensor (for the checks); refuses what cannot be a reward."""
    if not all(isinstance(p, torch.Tensor) for p in parts) or len({p.dtype for p in parts}) != 1:
        raise BadTrajectoryError(f"reward {_key_name(key)} must be a tensor of one dtype on every step, got "
                                 f"{sorted({type(p).__name__ + ':' + str(getattr(p, 'dtype', '')) for p in parts})}")
    return torch.cat([p.reshape(-1) for p in parts])


def flat_reward(td: TensorDictBase, key) -> tuple[torch.Tensor, int | None]:
    """The reward tensor the grouping manager decides on, and the step count when it differs from the
    tensor's first dim: per-token rewards of varying length are flattened to ``[tokens, 1]`` (their mean,
    std, sum and max are those of every token, as torchrl computes them on the nested rewards)."""
    reward = leaf_steps(td, key)
    if not isinstance(reward, list):
        if reward.ndim == 2 and not isinstance(td, LazyStackedTensorDict):
            return reward, None  # the dense [T, k] layout, as it is
        return reward.reshape(-1, 1), reward.shape[0]  # one shape for every member, whatever its steps hold
    return _flat_steps(reward, key).reshape(-1, 1), len(reward)


#: dtypes whose CPU tensors ``Tensor.numpy()`` views as they are
_NUMPY_VIEWABLE = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                             torch.float16, torch.float32, torch.float64})


def numpy_view(t) -> np.ndarray | None:
    """A numpy view of a plain CPU tensor, else None. The per-trajectory checks run on a few elements, where
    a numpy call costs a fraction of a torch op's dispatch, and such checks took a large part of what a writer
    spends on every trajectory it hands over (figures: docs/DESIGN.md, Figures behind code choices)."""
    if type(t) is torch.Tensor and t.dtype in _NUMPY_VIEWABLE and not t.requires_grad and t.device.type == "cpu":
        try:
            return t.numpy()
        except RuntimeError:  # e.g. a tensor with its negative bit set
            return None
    return None


def is_finite_number(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
