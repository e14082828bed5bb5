"""The service: the one process per run that owns the shared state (work units, leases, the rate-limit band,
the weights) and how workers reach it.

:mod:`~rbpipe.service.coordinator` (work units and run counters), :mod:`~rbpipe.service.journal` (its state on
disk), :mod:`~rbpipe.service.call_numbers` (calls run twice act once), :mod:`~rbpipe.service.registry_stats`,
:mod:`~rbpipe.service.host` (the coordinator on the grouping manager), :mod:`~rbpipe.service.weights` (the
learner's weights for collectors), :mod:`~rbpipe.service.endpoint` (``RUN_DIR/endpoint.json``: how a worker
finds it), :mod:`~rbpipe.service.clients` (the workers' side),
:mod:`~rbpipe.service.api` (the coordinator's remote method names) and :mod:`rbpipe.service.ray` (the same
service as Ray actors, ``--engine ray``). Its process is ``workers/serve.py``.
"""
