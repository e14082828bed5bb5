"""Data as torchrl's LLM stack hands it over: lazy-stacked steps with per-token rewards of varying length,
string prompts under ``"query"`` (torchrl's default group key), and custom candidate selectors. Each case is
checked against stock ``MCAdvantage`` on the same data, and against what the stores read back."""

from __future__ import annotations

import warnings

import multiprocess
import pytest
import tensordict
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.objectives.llm import MCAdvantage, MCAdvantageSelector

from rbpipe.buffer import make_replay_buffer
from rbpipe.errors import BadTrajectoryError, ConfigError
from rbpipe.grouping import SharedMCAdvantage
from rbpipe.grouping.staging import decode_td, encode_td
from rbpipe.storage import ArrowStorage, ZarrStorage

PROMPTS = ("Quelle est la capitale ? é", "2 + 2 = ?", "naïve tokens ✓")


def llm_traj(uid: int, prompt: str, steps: int, seed: int, wrapped: bool = False) -> tensordict.LazyStackedTensorDict:
    """One trajectory in torchrl's LLM layout: a lazy stack of steps, each with its own number of tokens
    (per-token rewards ``[n, 1]``, or ``[1, n, 1]`` as a one-element list becomes with ``set_list_to_stack``),
    a string prompt and a per-step text."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(steps):
        n = int(torch.randint(1, 7, (), generator=g))
        reward = torch.randn(n, 1, generator=g)
        row = TensorDict({"uid": torch.tensor(uid), ("tokens", "response"): torch.randint(0, 50, (n,), generator=g),
                          ("next", "reward"): reward.unsqueeze(0) if wrapped else reward,
                          ("next", "done"): torch.tensor([i == steps - 1])})
        row.set_non_tensor("query", prompt)
        row.set_non_tensor("text", f"step {i} of {uid}: ✓")
        rows.append(row)
    return lazy_stack(rows)


def stream(n_groups: int, grpo_size: int, wrapped: bool = False) -> list:
    return [llm_traj(g * grpo_size + k, PROMPTS[g % len(PROMPTS)] + f" #{g}", 1 + (g + k) % 3, 100 * g + k, wrapped)
            for g in range(n_groups) for k in range(grpo_size)]


def by_step(out) -> dict:
    """``(uid, text) -> (reward, advantage)`` for every step of a transform output or a store read."""
    rows = {}
    for row in out.unbind(0):
        rows[(int(row["uid"]), row["text"])] = (row["query"], row["next", "reward"].reshape(-1),
                                                row["advantage"].reshape(-1))
    return rows


def assert_same_steps(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, (query, reward, adv) in want.items():
        q, r, a = got[key]
        assert q == query
        assert torch.equal(r, reward)
        torch.testing.assert_close(a, adv)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapped", [False, True])
def test_lazy_per_token_rewards_match_torchrl(grouping_manager, wrapped):
    ours = SharedMCAdvantage(3, manager=grouping_manager)
    stock = MCAdvantage(3)
    for t in stream(3, 3, wrapped):
        want, got = stock.inv(t.clone()), ours.inv(t.clone())
        assert (want is None) == (got is None)
        if want is not None:
            assert_same_steps(by_step(got), by_step(want))
    assert ours.get_stats() == stock.get_stats()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sum", "max", "mean"])
def test_lazy_per_token_rewards_with_trajectory_returns(grouping_manager, mode):
    """torchrl cannot stack per-token rewards of varying length to reduce them; here each trajectory's return
    is reduced over all its tokens, then normalised across the group as torchrl does."""
    ours = SharedMCAdvantage(3, manager=grouping_manager, trajectory_return=mode)
    trajs = stream(1, 3)
    outs = [ours.inv(t.clone()) for t in trajs]
    assert outs[:2] == [None, None]
    reduce = {"sum": torch.sum, "max": torch.max, "mean": torch.mean}[mode]
    returns = torch.stack([reduce(torch.cat([r["next", "reward"].reshape(-1) for r in t.unbind(0)]))
                           for t in trajs])
    expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
    for (uid, _), (_, reward, adv) in by_step(outs[2]).items():
        torch.testing.assert_close(adv, expected[uid].expand_as(reward))
    stats = ours.get_stats()
    assert (stats["completed_decisions"], stats["written_groups"]) == (sum(t.shape[0] for t in trajs), 1)


@pytest.mark.timeout(60)
def test_defaults_are_torchrls(grouping_manager):
    t = SharedMCAdvantage(2, manager=grouping_manager)
    assert t.prompt_key == MCAdvantage(2).prompt_key == "query"
    assert set(t.required_keys) == {"query", ("next", "reward"), ("next", "done")}


def llm_writer(buffer, n_groups: int, grpo_size: int, writer: int) -> None:
    """Hands over every other trajectory of the stream: each group gets members from both writers."""
    torch.set_num_threads(1)
    for t in stream(n_groups, grpo_size):
        if int(t[0]["uid"]) % 2 == writer:
            buffer.extend(t)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", [ArrowStorage, ZarrStorage])
def test_two_writers_store_lazy_llm_groups(tmp_path, grouping_manager, backend):
    n_groups, grpo_size = 4, 2
    storage = backend(tmp_path / "store", group_key="query")
    buffer = make_replay_buffer(storage, grpo_size=grpo_size, manager=grouping_manager,
                                staging_dir=tmp_path / "staging", prompt_key="query")
    ctx = multiprocess.get_context("spawn")
    procs = [ctx.Process(target=llm_writer, args=(buffer, n_groups, grpo_size, w), daemon=True) for w in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()  # bounded by the test's timeout only: spawned interpreters start slowly on a loaded machine
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    stock = MCAdvantage(grpo_size)
    want = {}
    for t in stream(n_groups, grpo_size):
        out = stock.inv(t)
        if out is not None:
            want.update(by_step(out))
    reader = backend(tmp_path / "store", create=False, ragged_layout="rows")
    rows = reader.get(torch.arange(len(reader)))
    assert len(rows) == len(want)
    assert_same_steps(by_step(rows), want)
    assert buffer.grouping_transform.get_stats()["written_groups"] == n_groups


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", [ArrowStorage, ZarrStorage])
def test_string_prompts_grouped_stored_and_read_back(tmp_path, grouping_manager, backend):
    storage = backend(tmp_path / "store", group_key="query")
    buffer = make_replay_buffer(storage, grpo_size=2, manager=grouping_manager, staging_dir=tmp_path / "staging",
                                prompt_key="query")
    prompts = ["", "a\nb", "日本語 ✓ é", "x" * 300]
    for prompt in prompts:
        for reward in (0.0, 1.0):  # a dense (non-lazy) trajectory: one NonTensorData for its 2 steps
            td = TensorDict({("next", "reward"): torch.full((2, 1), reward),
                             ("next", "done"): torch.tensor([[False], [True]])}, batch_size=[2])
            td.set_non_tensor("query", prompt)
            buffer.extend(td)
    assert buffer.grouping_transform.get_stats()["written_groups"] == len(prompts)
    for layout in ("nested", "rows", "padded"):
        reader = backend(tmp_path / "store", create=False, ragged_layout=layout)
        got = reader.get(torch.arange(len(reader)))
        assert sorted(got.get("query").tolist()) == sorted(p for p in prompts for _ in range(4))
        assert sorted(got[i]["query"] for i in range(len(got))) == sorted(p for p in prompts for _ in range(4))
    if backend is ArrowStorage:  # FORMAT.md: a string column is an Arrow large_string that pyarrow reads alone
        import pyarrow as pa

        texts = []
        for segment in (tmp_path / "store" / "segments").iterdir():
            with open(segment, "rb") as f:
                reader = pa.ipc.open_stream(f)
                assert reader.schema.field("query").type == pa.large_string()
                texts += [t for batch in iter(reader.read_next_batch, None) for t in batch.column("query").to_pylist()]
        assert sorted(texts) == sorted(p for p in prompts for _ in range(4))
    buffer.grouping_transform.shutdown()


def test_staged_payload_keeps_strings_and_ragged_steps():
    t = llm_traj(7, "prompt ✓", 3, 0)
    back = decode_td(encode_td(t))
    assert [r["query"] for r in back.unbind(0)] == ["prompt ✓"] * 3
    assert [r["text"] for r in back.unbind(0)] == [r["text"] for r in t.unbind(0)]
    for a, b in zip(back.unbind(0), t.unbind(0), strict=True):
        assert torch.equal(a["next", "reward"], b["next", "reward"])
        assert torch.equal(a["tokens", "response"], b["tokens", "response"])
    dense = TensorDict({"a": torch.arange(3)}, batch_size=[3])
    assert encode_td(dense)[4] == 1  # all-tensor payloads keep format version 1


def test_non_str_objects_are_refused_before_anything_is_queued(grouping_manager):
    t = SharedMCAdvantage(2, manager=grouping_manager)
    good = llm_traj(0, "p", 2, 0)
    bad = llm_traj(1, "p", 2, 1)
    bad[0].set_non_tensor("meta", {"not": "a str"})
    bad[1].set_non_tensor("meta", {"not": "a str"})
    good[0].set_non_tensor("meta", "x")
    good[1].set_non_tensor("meta", "y")
    with pytest.raises(BadTrajectoryError, match="meta.*dict.*never pickles"):
        t.inv(lazy_stack([*good.unbind(0), *bad.unbind(0)]))  # two trajectories back to back
    assert t.get_stats()["queued_trajectories"] == 0


class TopScore(MCAdvantageSelector):
    """Keeps the candidates with the highest per-trajectory score (a field the selector declares)."""

    def __init__(self) -> None:
        super().__init__(in_keys=[("trajectories", "score")])

    def select(self, candidates, *, group_size, keep_return_bounds=None):
        trajs = candidates.get("trajectories")
        scores = torch.stack([t.get("score")[0] for t in trajs.unbind(0)])
        return scores.topk(group_size).indices.tolist()


class Broken(MCAdvantageSelector):
    def select(self, candidates, *, group_size, keep_return_bounds=None):
        raise ValueError("selector bug")


def scored(group: str, score: float, rewards: list[float]) -> TensorDict:
    n = len(rewards)
    td = TensorDict({"score": torch.full((n,), score), ("next", "reward"): torch.tensor(rewards).reshape(n, 1),
                     ("next", "done"): torch.tensor([False] * (n - 1) + [True]).reshape(n, 1)}, batch_size=[n])
    td.set_non_tensor("query", group)
    return td


SELECT = {"trajectory_return": "sum", "candidate_group_size": 3, "candidate_selection_min_size": 3}


@pytest.mark.timeout(60)
def test_custom_selector_sees_its_declared_fields(grouping_manager):
    ours = SharedMCAdvantage(2, manager=grouping_manager, candidate_selector=TopScore(),
                             **SELECT)
    stock = MCAdvantage(2, candidate_selector=TopScore(), **SELECT)
    for score, rewards in [(0.0, [0.0]), (2.0, [1.0, 0.0]), (1.0, [0.0])]:
        want, got = stock.inv(scored("q", score, rewards)), ours.inv(scored("q", score, rewards))
    assert got["score"].tolist() == want["score"].tolist() == [2.0, 2.0, 1.0]
    torch.testing.assert_close(got["advantage"], want["advantage"])
    assert got[0]["query"] == "q"
    assert ours.get_stats() == stock.get_stats()


@pytest.mark.timeout(60)
def test_raising_selector_drops_its_group_instead_of_sticking(grouping_manager):
    ours = SharedMCAdvantage(2, manager=grouping_manager, candidate_selector=Broken(),
                             **SELECT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for score in range(3):
            assert ours.inv(scored("q", float(score), [float(score)])) is None
    assert any("selector bug" in str(w.message) for w in caught)
    stats = ours.get_stats()
    assert (stats["dropped_groups"], stats["queued_trajectories"]) == (1, 0)
    assert ours.drop_reasons()["selector_error"] == 1
    assert ours.inv(scored("q", 0.0, [0.0])) is None  # the group id starts afresh
    assert ours.get_stats()["queued_trajectories"] == 1
    assert not list(ours.staging.path.glob("*/*.td"))[1:]  # only the new one is staged


def test_selector_reading_other_keys_is_refused_at_construction(grouping_manager):
    with pytest.raises(ConfigError, match="'return' and \\('trajectories', <field>\\)"):
        SharedMCAdvantage(2, manager=grouping_manager, candidate_selector=MCAdvantageSelector(in_keys=["metadata"]),
                          **SELECT)


@pytest.mark.timeout(60)
def test_selector_field_missing_is_a_clear_error(grouping_manager):
    ours = SharedMCAdvantage(2, manager=grouping_manager, candidate_selector=TopScore(),
                             **SELECT)
    with pytest.raises(BadTrajectoryError, match="score"):
        ours.inv(scored("q", 0.0, [0.0]).exclude("score"))
    assert ours.get_stats()["queued_trajectories"] == 0
