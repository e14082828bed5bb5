"""Where a handle's shared state lives, and how each process holding a handle reaches it.

A handle made where no rbpipe service runs starts a grouping manager (one process, owned by the creating
process: it exits with it) and keeps the store on disk; one made with a service's run directory attaches to
that service (``rbpipe serve``, local or Ray engine). Either way, what a handle carries to another process is
a :class:`Spec`: plain data (paths, the manager's address and key, the registry's name, the grouping options),
from which :func:`open_buffer` rebuilds the same buffer there.

rbpipe internals used here, and only here: ``rbpipe.buffer`` (the grouping buffer and manager start/join),
``rbpipe.grouping.manager.manager_address``, ``rbpipe.service.endpoint`` (attaching to a service), ``rbpipe.storage``,
``rbpipe.trajectory`` (a service's store options) and ``rbpipe.sampling`` (the fresh-group sampler).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rbpipe.errors import ConfigError

#: MCAdvantage's options that the handle passes through (``grpo_size`` and ``prompt_key`` are arguments)
MCADVANTAGE_OPTIONS = ("rewards_key", "advantage_key", "done_key", "trajectory_return", "keep_return_bounds",
                       "candidate_group_size", "candidate_selection_min_size", "candidate_selector", "verbose")
SAMPLERS = ("random", "without_replacement", "fresh")
#: the fields of torchrl's LLM layout whose length varies from step to step. A store infers the others' shapes
#: from its first group: a batch whose prompts happened to be of one length would fix ``("tokens", "prompt")``'s
#: and every later group with another length would be refused, so these are declared when the store is created
#: (per-token rewards, and so advantages, vary too)
LLM_RAGGED_KEYS = tuple((group, name) for group, names in (
    ("tokens", ("prompt", "response", "full")), ("log_probs", ("prompt", "response", "full")),
    ("masks", ("all_attention_mask", "all_assistant_mask"))) for name in names) + (("next", "reward"), "advantage")


@dataclass(frozen=True)
class Spec:
    """Everything another process needs to reattach (pickled with the handle; no live object inside)."""

    store: str
    grpo_size: int
    batch_size: int | None
    prompt_key: Any
    grouping: dict = field(default_factory=dict)
    sampler: Any = "random"
    backend: str = "arrow"
    run_dir: str | None = None
    address: Any = None
    authkey: bytes | None = None
    registry: str = ""
    write_transforms: tuple = ()
    read_transforms: tuple = ()
    ragged_keys: tuple = ()

    def with_transform(self, transform, invert: bool) -> Spec:
        if invert:
            return replace(self, write_transforms=(*self.write_transforms, transform))
        return replace(self, read_transforms=(*self.read_transforms, transform))


def new_local(store: str | Path, *, listen: tuple[str, int] | None, **fields: Any) -> tuple[Spec, Any]:
    """Start a grouping manager for a handle made where no service runs: ``(spec, manager)``."""
    from rbpipe.buffer import start_manager
    from rbpipe.grouping.manager import manager_address

    store = Path(store).absolute()
    if store.exists() and not store.is_dir():
        raise ConfigError(f"store={str(store)!r} is a file: pass a new or existing store directory")
    manager = start_manager(address=listen)
    address, authkey = manager_address(manager)
    spec = Spec(store=str(store), address=address, authkey=authkey, registry=f"torchrl-{uuid.uuid4().hex[:12]}",
                **fields)
    return spec, manager


def new_attached(run_dir: str | Path, store: str | Path | None, **fields: Any) -> Spec:
    """The spec of a handle on the service whose run directory is ``run_dir`` (checked by attaching once)."""
    from rbpipe.service.endpoint import REGISTRY_NAME, attach

    attachment = attach(run_dir)
    cfg = attachment.config()
    if store is not None and Path(store).absolute() != attachment.store.absolute():
        raise ConfigError(f"store={str(store)!r} is not the store of the service at {run_dir} "
                          f"({attachment.store}): drop store=, or pass the service's")
    if int(fields["grpo_size"]) != int(cfg.grpo_size):
        raise ConfigError(f"grpo_size={fields['grpo_size']} differs from the service's ({cfg.grpo_size}): every "
                          f"writer of a service groups by its grpo_size; pass grpo_size={cfg.grpo_size}, or start a "
                          f"service with `rbpipe serve --grpo-size {fields['grpo_size']}`")
    grouping = dict(fields.pop("grouping"))
    service_options = cfg.grouping_kwargs()
    service_options.pop("grpo_size")
    for name, value in service_options.items():
        mine = grouping.get(name)
        if mine is not None and name != "candidate_selector" and mine != value:
            raise ConfigError(f"{name}={mine!r} differs from the service's ({value!r}): drop it, or start a "
                              "service with it")
    grouping.update({k: v for k, v in service_options.items() if v is not None})
    return Spec(store=str(attachment.store), run_dir=str(Path(run_dir).absolute()), registry=REGISTRY_NAME,
                backend=cfg.backend, grouping=grouping, **fields)


def _open_manager(spec: Spec, manager: Any) -> tuple[Any, Any]:
    """``(manager, run config or None)`` of ``spec`` in this process."""
    if manager is not None:
        return manager, None
    if spec.run_dir is not None:
        from rbpipe.service.endpoint import attach

        attachment = attach(spec.run_dir)
        return attachment.manager, attachment.config()
    from rbpipe.buffer import connect_manager

    return connect_manager(spec.address, spec.authkey or b""), None


def _open_store(spec: Spec, cfg: Any):
    """The store, read as rows (torchrl's LLM data comes back as ``LazyStackStorage`` gives it); a service's
    with the options its own workers open it with (``rbpipe.service.clients.open_run_store``)."""
    from rbpipe.storage import ArrowStorage, ZarrStorage

    cls = {"arrow": ArrowStorage, "zarr": ZarrStorage}.get(spec.backend)
    if cls is None:
        raise ConfigError(f"backend={spec.backend!r}: use 'arrow' or 'zarr'")
    if cfg is not None:
        from rbpipe.trajectory import GROUP_KEY, RAGGED_KEYS

        return cls(spec.store, ragged_keys=RAGGED_KEYS, group_key=GROUP_KEY, ragged_layout="rows")
    return cls(spec.store, group_key=spec.prompt_key, ragged_layout="rows",
               ragged_keys=(*LLM_RAGGED_KEYS, *spec.ragged_keys))


def make_sampler(spec: Spec):
    """The torchrl sampler ``spec.sampler`` names (a name, a ``Sampler`` class, or an instance)."""
    from torchrl.data.replay_buffers.samplers import RandomSampler, Sampler, SamplerWithoutReplacement

    choice = spec.sampler
    if isinstance(choice, Sampler):
        return choice
    if isinstance(choice, type) and issubclass(choice, Sampler):
        return choice()
    if choice == "random":
        return RandomSampler()
    if choice == "without_replacement":
        return SamplerWithoutReplacement()
    if choice == "fresh":
        from rbpipe.sampling import FreshGroupSampler

        if spec.batch_size is None or spec.batch_size % spec.grpo_size:
            raise ConfigError(f"sampler='fresh' samples whole groups: batch_size ({spec.batch_size}) must be a "
                              f"multiple of grpo_size ({spec.grpo_size})")
        return FreshGroupSampler(num_groups=spec.batch_size // spec.grpo_size)
    raise ConfigError(f"sampler={choice!r}: use one of {', '.join(SAMPLERS)}, a torchrl Sampler class or instance")


def open_buffer(spec: Spec, manager: Any = None):
    """The grouping buffer of ``spec`` in this process (``manager``: the owner's own, when it is the owner)."""
    from rbpipe.buffer import make_replay_buffer

    manager, cfg = _open_manager(spec, manager)
    storage = _open_store(spec, cfg)
    return make_replay_buffer(storage, grpo_size=spec.grpo_size, manager=manager,
                              staging_dir=Path(spec.store) / "staging", name=spec.registry,
                              sampler=make_sampler(spec), batch_size=spec.batch_size, prompt_key=spec.prompt_key,
                              **spec.grouping)
