"""Process wiring for ``rbpipe run``: collector, learner and launcher/supervisor. No algorithms live here."""
