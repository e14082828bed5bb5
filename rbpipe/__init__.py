"""rbpipe: shared, persistent GRPO replay buffers built on torchrl.

Collectors write trajectories through a manager-backed ``MCAdvantage`` grouping transform into an
on-disk store; a learner samples whole groups from that store and trains with torchrl's GRPO losses.
"""

__version__ = "0.1.0"
