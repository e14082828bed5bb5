"""The model side of a collector: load the model (``--device``, ``--dtype``, ``.gguf``), turn prompts into tokens,
sample responses that stop, call the reward, and build trajectories (:mod:`~rbpipe.model.rollout`)."""
