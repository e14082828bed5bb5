"""Group-aware sampling over committed groups: whole groups, consume-once, staleness-limited."""

from rbpipe.sampling.group_sampler import FreshGroupSampler

__all__ = ["FreshGroupSampler"]
