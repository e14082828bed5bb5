"""Process wiring for ``rbpipe run``: collector, learner and launcher/supervisor. No algorithms live here.

This folder sits at the top of the repository but is the package ``rbpipe.workers`` (never a top-level
``workers`` package): ``rbpipe/workers`` is a relative symbolic link to it. Every tool then sees an ordinary
subpackage: setuptools' package discovery follows the link (a wheel holds the files under ``rbpipe/workers/``),
an editable install imports it through ``rbpipe``'s own folder, and mypy and the import-graph test check it
with the rest of the package (docs/ARCHITECTURE.md, 'Packaging').

Import it as ``rbpipe.workers.<module>`` everywhere (imports, spawn targets, docs).
"""

if __name__ != "rbpipe.workers":  # e.g. `import workers` from the repository root, where the folder is on sys.path
    raise ImportError(f"this folder is the package rbpipe.workers: import rbpipe.workers.<module>, not {__name__}")
