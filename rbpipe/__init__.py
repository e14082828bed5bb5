"""rbpipe: shared, persistent GRPO replay buffers built on torchrl.

Collectors write trajectories through a manager-backed ``MCAdvantage`` grouping transform into an
on-disk store; a learner samples whole groups from that store and trains with torchrl's GRPO losses.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__version__ = "0.1.0"

#: the public API, imported on first use (``rbpipe inspect``/``query`` must not pay for torch)
_EXPORTS = {
    "connect": "rbpipe.service.clients", "connect_learner": "rbpipe.service.clients",
    "CollectorClient": "rbpipe.service.clients",
    "LearnerClient": "rbpipe.service.clients", "RunConfig": "rbpipe.config", "SharedMCAdvantage": "rbpipe.grouping",
    "make_replay_buffer": "rbpipe.buffer", "open_storage": "rbpipe.storage", "group_buffer": "rbpipe.storage",
    "ArrowStorage": "rbpipe.storage", "ZarrStorage": "rbpipe.storage", "FreshGroupSampler": "rbpipe.sampling",
    "RateLimiter": "rbpipe.rate_limit", "replay_buffer": "rbpipe.torchrl_compat",
    "TorchRLReplayBuffer": "rbpipe.torchrl_compat",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rbpipe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


#: module paths that README.md, examples/ and docs/RAY.md name from before the package was sorted into rooms
#: (issue 34). Importing one (or a module below it) gives the module at its new path: the same object, so
#: isinstance, pickling and monkeypatching agree. No file stays at the old path.
MOVED = {"rbpipe.schema": "rbpipe.trajectory", "rbpipe.query": "rbpipe.storage.query",
         "rbpipe.procs": "rbpipe.system.procs", "rbpipe.rayengine": "rbpipe.service.ray"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of a :data:`MOVED` path with the module at its new path. It sits first on
    ``sys.meta_path`` so that ``rbpipe.rayengine.session`` is not found again, as a second copy, through the
    new package's ``__path__``."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    @staticmethod
    def new_name(name: str) -> str | None:
        for old, new in MOVED.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return None

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if self.new_name(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.new_name(spec.name)
        assert new is not None
        module = importlib.import_module(new)
        self._specs[module.__name__] = module.__spec__  # the import system overwrites it with the alias's
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
