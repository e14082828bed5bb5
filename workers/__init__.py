"""Process wiring for ``rbpipe run``: collector, learner and launcher/supervisor. No algorithms live here.

This folder sits at the top of the repository but installs as ``rbpipe.workers`` (never as a top-level
``workers`` package): ``pyproject.toml`` maps it with ``package-dir = {"rbpipe.workers" = "workers"}``.

* A wheel (or ``pip install .``) copies it to ``rbpipe/workers/``.
* An editable install (``pip install -e .``) cannot copy it, so setuptools installs a meta-path finder
  (``__editable___rbpipe_*_finder.py``, loaded by a ``.pth`` file at start-up, so also in spawned children
  and Ray workers) whose mapping names ``rbpipe.workers`` -> this folder. Python asks that finder after the
  normal path search, so ``rbpipe.workers`` resolves even when ``rbpipe`` itself is imported from the
  current directory (the repository root), whose ``rbpipe/`` has no ``workers``: ``rbpipe.__path__`` is
  searched first, finds nothing, and the editable finder answers. ``rbpipe/__init__.py`` needs no
  ``__path__`` change. Keep ``rbpipe/workers/`` from existing in the source tree: even an empty leftover
  folder there would be found first, as a namespace package, and hide this one.

Import it as ``rbpipe.workers.<module>`` everywhere (imports, spawn targets, docs).
"""

if __name__ != "rbpipe.workers":  # e.g. `import workers` from the repository root, where the folder is on sys.path
    raise ImportError(f"this folder is the package rbpipe.workers: import rbpipe.workers.<module>, not {__name__}")
