"""torchrl's own LLM stack on rbpipe: :func:`replay_buffer`, a handle that torchrl's GRPO recipe uses in place of
``RayReplayBuffer`` (``docs/TORCHRL.md``)."""

from rbpipe.torchrl_compat.handle import TorchRLReplayBuffer, replay_buffer

__all__ = ["TorchRLReplayBuffer", "replay_buffer"]
