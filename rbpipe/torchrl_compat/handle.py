"""``rbpipe.replay_buffer(...)``: the buffer handle torchrl's GRPO recipe takes in place of ``RayReplayBuffer``.

What a handle does per call (``docs/TORCHRL.md`` has the recipe's lines before and after, and what differs):

- ``extend``/``add`` (any process holding the handle): the write transforms, then :mod:`.codec` (torchrl's LLM
  tensorclasses as plain rows), then rbpipe's grouping buffer: ``MCAdvantage``'s decision made across every
  process by ``prompt_key``, ``"advantage"`` set, each completed group committed whole to the store by the
  process that completed it;
- ``sample``/``rb[index]``/iteration: rows read from the store (what every process committed), decoded back to
  torchrl's layout, then the read transforms. The default sampler is torchrl's ``RandomSampler`` (with
  replacement); ``sampler="fresh"`` is rbpipe's consume-once sampler of whole fresh groups.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from rbpipe.errors import ConfigError
from rbpipe.torchrl_compat import codec
from rbpipe.torchrl_compat.connection import (
    MCADVANTAGE_OPTIONS,
    Spec,
    make_sampler,
    new_attached,
    new_local,
    open_buffer,
)


class TorchRLReplayBuffer:
    """A handle on a shared, persistent GRPO replay buffer, used the way torchrl's ``ReplayBuffer`` is.

    Made by :func:`replay_buffer`; pickles as plain data (:class:`~.connection.Spec`) and reattaches to the same
    grouping state and store in whichever process unpickles it (``multiprocess``/``multiprocessing`` children
    of any start method, Ray actors and tasks).
    """

    def __init__(self, spec: Spec, *, manager: Any = None) -> None:
        self._spec = spec
        self._owner = manager is not None
        self._manager = manager
        self._buffer = open_buffer(spec, manager)
        self._write_count_base = 0
        self._iterator: Iterator[TensorDictBase] | None = None  # next()'s batches, made on its first call
        if self._owner:
            self._buffer.requeue_staged()  # what a previous session of this store left queued goes on
            self._finalizer = weakref.finalize(self, _shut_down, self._buffer, manager)  # runs at exit too

    # -- pickling: the spec travels, each process opens its own connections ------------------------------------
    def __getstate__(self) -> dict:
        return {"spec": self._spec, "write_count_base": self._write_count_base}

    def __setstate__(self, state: dict) -> None:
        TorchRLReplayBuffer.__init__(self, state["spec"])
        self._write_count_base = state["write_count_base"]

    # -- writing -----------------------------------------------------------------------------------------------
    def extend(self, data: TensorDictBase, *, update_priority=None) -> torch.Tensor:
        """Hand trajectories over (``[N]`` steps, as ``LLMCollector`` writes them): returns the store rows of the
        groups this call completed (empty while their groups wait for members)."""
        if update_priority is not None:
            raise ConfigError("update_priority: this buffer has no prioritized sampler; leave it out")
        for transform in reversed(self._spec.write_transforms):  # torchrl's Compose.inv order
            data = transform.inv(data)
            if data is None:
                return torch.zeros((0,), dtype=torch.long)
        return self._buffer.extend(codec.encode(data))

    def add(self, data: TensorDictBase) -> torch.Tensor:
        """One step (a ``[]`` TensorDict) or one trajectory."""
        return self.extend(data.unsqueeze(0) if data.ndim == 0 else data)

    # -- reading -----------------------------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """``batch_size`` rows (default: the handle's) drawn by its sampler from every process's commits, in
        torchrl's LLM layout (lazy stack of rows; ``Text``/``Tokens``/``LogProbs``/``Masks``/``ChatHistory``)."""
        out = self._buffer.sample(batch_size, return_info=return_info)
        if return_info:
            data, info = out
            return self._read(data), info
        return self._read(out)

    def _read(self, data: TensorDictBase) -> TensorDictBase:
        data = codec.decode(data)
        for transform in self._spec.read_transforms:
            data = transform(data)
        return data

    def __getitem__(self, index) -> TensorDictBase:
        return self._read(self._buffer._storage.get(index))

    def __len__(self) -> int:
        return len(self._buffer)

    def __iter__(self) -> Iterator[TensorDictBase]:
        """As torchrl's: batches until the sampler runs out (never, for the default random sampler)."""
        sampler = self._buffer._sampler
        if self._spec.batch_size is None:
            raise RuntimeError("cannot iterate over the buffer: it was made without batch_size")
        sampler.ran_out = False
        while not sampler.ran_out:
            yield self.sample()

    def next(self) -> TensorDictBase | None:
        """One batch of :meth:`__iter__`, or None once the sampler ran out (torchrl's ``next``)."""
        if self._iterator is None:
            self._iterator = iter(self)
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = None
            return None

    # -- counters and state -----------------------------------------------------------------------------------
    @property
    def write_count(self) -> int:
        """Trajectories committed to the store through this buffer's grouping (all processes: whole groups of
        ``grpo_size``), since it started or since this handle's last ``empty(empty_write_count=True)``."""
        return int(self.grouping_stats()["written_groups"]) * self._spec.grpo_size - self._write_count_base

    def grouping_stats(self) -> dict:
        """``MCAdvantage.get_stats()`` of the shared grouping (torchrl's keys, plus queue sizes)."""
        return self._buffer.grouping_transform.get_stats()

    @property
    def batch_size(self) -> int | None:
        return self._spec.batch_size

    @property
    def storage(self):
        return self._buffer._storage

    @property
    def sampler(self):
        return self._buffer._sampler

    @property
    def store(self) -> Path:
        return Path(self._spec.store)

    def empty(self, empty_write_count: bool = True) -> None:
        """Evict every committed group from the store (for every process: the store is shared) and reset the
        sampler; queued, incomplete groups stay queued (they are not in the store yet)."""
        if empty_write_count:
            self._write_count_base += self.write_count
        self._buffer.empty(empty_write_count=empty_write_count)

    def append_transform(self, transform, *, invert: bool = False) -> TorchRLReplayBuffer:
        """torchrl's semantics: ``invert=True`` runs ``transform.inv`` on what is written (before the grouping,
        in the writing process), ``invert=False`` runs it on what is sampled. It must pickle: it travels with the
        handle to the processes given the handle *after* this call."""
        try:
            pickle.dumps(transform)
        except Exception as err:  # noqa: BLE001 - whatever pickle raises, the transform cannot travel
            raise ConfigError(f"append_transform: {type(transform).__name__} cannot be pickled ({err}), so it "
                              "could not run in the other processes holding this buffer; make it picklable "
                              "(no lambdas, open files or locks), or apply it before extend()/after sample()"
                              ) from None
        self._spec = self._spec.with_transform(transform, invert)
        return self

    def close(self) -> None:
        """Leave: this process's unconfirmed claims go to the other writers at once. The owner (the process
        that made the buffer) also stops the grouping manager it started; done at its exit otherwise."""
        if self._owner:
            self._finalizer()
        else:
            self._buffer.grouping_transform.close()
            self._buffer._storage.close()

    def __enter__(self) -> TorchRLReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"service {self._spec.run_dir}" if self._spec.run_dir else "own grouping manager"
        return (f"TorchRLReplayBuffer(store={self._spec.store!r}, grpo_size={self._spec.grpo_size}, "
                f"batch_size={self._spec.batch_size}, prompt_key={self._spec.prompt_key!r}, {where})")


def _shut_down(buffer, manager) -> None:
    try:
        buffer.grouping_transform.close()
        buffer._storage.close()
    finally:
        manager.shutdown()


def replay_buffer(store: str | Path | None = None, *, grpo_size: int, batch_size: int | None = None,
                  prompt_key="query", run_dir: str | Path | None = None, sampler: Any = "random",
                  backend: str = "arrow", listen: tuple[str, int] | None = None, ragged_keys=(),
                  **mcadvantage_options: Any) -> TorchRLReplayBuffer:
    """A shared GRPO replay buffer for torchrl's LLM stack, in place of ``RayReplayBuffer(storage=LazyStackStorage,
    transform_factory=partial(MCAdvantage, grpo_size=...), batch_size=...)``.

    Args:
        store: the store directory (created if new; an existing one is resumed, staged trajectories included).
        grpo_size: trajectories per group (``MCAdvantage``'s ``grpo_size``).
        batch_size: rows per ``sample()`` and per batch of iteration.
        prompt_key: the key whose value groups trajectories (torchrl's ``"query"``).
        run_dir: attach to the running ``rbpipe serve`` of this run directory instead of starting anything
            (its store, grouping options and engine, Ray included).
        sampler: ``"random"`` (torchrl's default, with replacement), ``"without_replacement"`` (as
            ``grpo-sync.py`` passes), ``"fresh"`` (rbpipe: whole groups, each once), or a torchrl
            ``Sampler`` class or instance.
        backend: ``"arrow"`` or ``"zarr"`` for a new store.
        ragged_keys: keys of your own whose length varies between steps, beside torchrl's LLM fields (declared
            when a new store is created).
        listen: ``(host, port)`` for the grouping manager to listen on TCP, so processes on other hosts that
            see the store can write (default: a Unix socket, this host only).
        mcadvantage_options: ``MCAdvantage``'s other options (``rewards_key``, ``advantage_key``, ``done_key``,
            ``trajectory_return``, ``keep_return_bounds``, ``candidate_group_size``, ...).

    Examples:
        >>> import rbpipe, tempfile
        >>> rb = rbpipe.replay_buffer(tempfile.mkdtemp() + "/store", grpo_size=4, batch_size=8)
        >>> len(rb), rb.write_count
        (0, 0)
        >>> # LLMCollector(env, policy=policy, replay_buffer=rb, ...); then rb.sample() for GRPOLoss
        >>> rb.close()
    """
    unknown = sorted(set(mcadvantage_options) - set(MCADVANTAGE_OPTIONS))
    if unknown:
        raise ConfigError(f"replay_buffer() got unknown option(s) {', '.join(unknown)}: it takes store, grpo_size, "
                          f"batch_size, prompt_key, run_dir, sampler, backend, listen, ragged_keys and MCAdvantage's "
                          f"{', '.join(MCADVANTAGE_OPTIONS)}")
    if int(grpo_size) < 1:
        raise ConfigError(f"grpo_size must be >= 1, got {grpo_size}")
    if batch_size is not None and int(batch_size) < 1:
        raise ConfigError(f"batch_size must be >= 1 or None, got {batch_size}")
    fields = dict(grpo_size=int(grpo_size), batch_size=None if batch_size is None else int(batch_size),
                  prompt_key=prompt_key, sampler=sampler, grouping=dict(mcadvantage_options))
    if run_dir is not None:
        spec = new_attached(run_dir, store, **fields)
        make_sampler(spec)  # a bad sampler is refused here, not in the collectors
        return TorchRLReplayBuffer(spec)
    if store is None:
        raise ConfigError("replay_buffer() needs store= (a directory for a new or existing store), or run_dir= of a "
                          "running `rbpipe serve`")
    make_sampler(Spec(store=str(store), **dict(fields, grouping={})))
    spec, manager = new_local(store, listen=listen, backend=backend, ragged_keys=tuple(ragged_keys), **fields)
    try:
        return TorchRLReplayBuffer(spec, manager=manager)
    except BaseException:
        manager.shutdown()
        raise
