"""A run's bookkeeping: the metrics log, the progress line, peak memory, the summary and report, and the thread
that writes them beside the work (:mod:`~rbpipe.tracking.background`)."""
