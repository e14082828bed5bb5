"""``rbpipe`` command line (:mod:`~rbpipe.cli.commands`) and the torch-free tools behind ``inspect``, ``query``
and ``stress``. ``rbpipe.cli:main`` is the console script's entry point; ``python -m rbpipe.cli`` runs it too."""

from rbpipe.cli.commands import main

__all__ = ["main"]
