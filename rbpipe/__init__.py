"""rbpipe: shared, persistent GRPO replay buffers built on torchrl.

Collectors write trajectories through a manager-backed ``MCAdvantage`` grouping transform into an
on-disk store; a learner samples whole groups from that store and trains with torchrl's GRPO losses.
"""

__version__ = "0.1.0"

#: the public API, imported on first use (``rbpipe inspect``/``query`` must not pay for torch)
_EXPORTS = {
    "connect": "rbpipe.clients", "connect_learner": "rbpipe.clients", "CollectorClient": "rbpipe.clients",
    "LearnerClient": "rbpipe.clients", "RunConfig": "rbpipe.config", "SharedMCAdvantage": "rbpipe.grouping",
    "make_replay_buffer": "rbpipe.buffer", "open_storage": "rbpipe.storage", "group_buffer": "rbpipe.storage",
    "ArrowStorage": "rbpipe.storage", "ZarrStorage": "rbpipe.storage", "FreshGroupSampler": "rbpipe.sampling",
    "RateLimiter": "rbpipe.rate_limit", "replay_buffer": "rbpipe.torchrl_compat",
    "TorchRLReplayBuffer": "rbpipe.torchrl_compat",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    import importlib

    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rbpipe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
