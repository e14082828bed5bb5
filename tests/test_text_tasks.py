"""Text tasks (issue 38): prompts as text or chat messages through the model's chat template, responses that stop
at EOS or a stop string, rewards over the decoded text, text in the store, prompts from a data file, and bad
input (rewards that raise or hang, prompts too long, a data file without --prompt-key).

In-process tests check the pieces on a tiny chat model made in code (``text_model.py``); two real ``rbpipe run``
runs (subprocesses in their own session, killed whatever happens) check what lands in the store.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from text_model import EOS_ID, chat_model, chat_tokenizer, save_chat_model

from rbpipe.demo.arithmetic import AdditionTask, SingleDigitAdditionTask
from rbpipe.errors import ConfigError
from rbpipe.model.generation import LENGTH, STOP, Sampling, generate
from tests.process_helpers import assert_run_refuses, run_cli

RUN = [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--json", "--steps", "3", "--collectors", "2",
       "--groups-per-step", "2", "--grpo-size", "4", "--max-new-tokens", "24", "--lr", "1e-3"]

# A text task written by the test. Its reward depends on the prompt only through the digit after "say", which the
# templated text_prompt holds too, so the stored reward can be recomputed from text_prompt and text_response.
# With MARKERS set, the first reward call of the whole run (any process) raises and the second hangs: exactly one
# reward_error and one reward_timeout, whatever the interleaving.
TASK_FILE = '''
import os, re, time


def _first(name):
    d = os.environ.get("MARKERS")
    if not d:
        return False
    try:
        os.close(os.open(os.path.join(d, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class SayTask:
    def __init__(self, seed=0):
        self.seed = seed

    def prompt(self, index):
        n = (index * 7 + self.seed) % 10
        return f"say {n}" if index % 2 else [{"role": "system", "content": "be short"},
                                             {"role": "user", "content": f"say {n}"}]

    def reward(self, prompt, response):
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        if _first("error"):
            raise ValueError("first reward call fails on purpose")
        if _first("hang"):
            time.sleep(60)
        digit = re.search(r"say (\\d)", text).group(1)
        return response.count(digit) + 0.1 * (len(response) % 7)


class Messages:
    def prompt(self, index):
        return [{"role": "user", "content": "hi"}]

    def reward(self, prompt, response):
        return 0.0


class Long:
    def prompt(self, index):
        return "a" * 200

    def reward(self, prompt, response):
        return 0.0
'''

REWARD_FILE = '''
def score(prompt, response, answer, bonus, **rest):
    assert not rest, rest
    return float(response.count(str(answer))) + float(bonus)
'''


def _import(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stored(store: Path) -> list[dict]:
    """Every stored trajectory: token ids from the store itself, texts and finish reasons from ``rbpipe query``."""
    from rbpipe.storage import open_storage
    from rbpipe.storage.query import query

    storage = open_storage(store)
    rows = storage.get(torch.arange(len(storage))).unbind(0)
    table = query(store, "select seq, member, group_id, next_reward, finish_reason, text_prompt, text_response, "
                         "tokens_response_len from trajectories order by seq, member").to_pylist()
    assert len(table) == len(rows)
    out = []
    for row, t in zip(rows, table, strict=True):
        response = row.get(("tokens", "response")).reshape(-1)
        assert int(row.get("group_id").reshape(-1)[0]) == t["group_id"]
        assert response.numel() == t["tokens_response_len"]
        out.append({**t, "response": response})
    return out


def check_responses(rows: list[dict], max_new_tokens: int) -> None:
    tokenizer = chat_tokenizer()
    for r in rows:
        tokens = r["response"].tolist()
        assert EOS_ID not in tokens[:-1], r  # nothing stored after a stop token
        if r["finish_reason"] == STOP:
            assert tokens[-1] == EOS_ID, r
        else:
            assert r["finish_reason"] == LENGTH and len(tokens) == max_new_tokens and tokens[-1] != EOS_ID, r
        assert r["text_response"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert {STOP, LENGTH} <= {r["finish_reason"] for r in rows}
    assert len({len(r["response"]) for r in rows}) > 3, "response lengths should vary"


# -- the pieces, in one process ------------------------------------------------------------------------------------

def test_rows_stop_at_eos_independently_with_the_log_probs_they_were_sampled_with():
    model, tokenizer = chat_model(), chat_tokenizer()
    prompts = [torch.tensor(tokenizer(s)["input_ids"]) for s in ("say 1", "say 12 now", "x")]  # left-padded
    sampling = Sampling(max_new_tokens=24, temperature=0.7, top_k=40, top_p=0.97, stop_ids=(EOS_ID,))
    out = generate(model, prompts, [6, 5, 7], sampling, pad_id=0, generator=torch.Generator().manual_seed(0))
    rows = [(p, r) for p, rs in zip(prompts, out, strict=True) for r in rs]
    assert [len(rs) for rs in out] == [6, 5, 7]
    assert {r.finish_reason for _, r in rows} == {STOP, LENGTH}
    assert len({r.tokens.numel() for _, r in rows}) > 3
    with torch.no_grad():
        for prompt, r in rows:
            tokens = r.tokens.tolist()
            assert EOS_ID not in tokens[:-1] and (tokens[-1] == EOS_ID) == (r.finish_reason == STOP)
            # the rollout log-probs are those of the distribution sampled: temperature, top-k, top-p applied
            logits = model(input_ids=torch.cat([prompt, r.tokens])[None]).logits[0, prompt.numel() - 1:-1].float()
            logits = logits / 0.7
            kth = torch.topk(logits, 40, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
            outside = probs.cumsum(-1) - probs > 0.97
            logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
            expected = torch.log_softmax(logits, -1).gather(-1, r.tokens[:, None]).reshape(-1)
            torch.testing.assert_close(r.log_probs, expected, atol=1e-4, rtol=1e-4)


def test_the_batch_ends_when_every_row_has_stopped():
    model, tokenizer = chat_model(), chat_tokenizer()
    forwards: list[int] = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:  # half the vocabulary stops a row: every row stops within a few tokens, far below the cap
        (rows,) = generate(model, [torch.tensor(tokenizer("say 5")["input_ids"])], [8],
                           Sampling(max_new_tokens=64, stop_ids=tuple(range(0, 48, 2))),
                           generator=torch.Generator().manual_seed(2))
    finally:
        hook.remove()
    lengths = [r.tokens.numel() for r in rows]
    assert all(r.finish_reason == STOP for r in rows) and len(set(lengths)) > 1
    assert len(forwards) == max(lengths) < 64  # one forward per token of the longest row, not to the cap


def test_a_stop_string_ends_the_response_at_the_token_that_completes_it():
    model, tokenizer = chat_model(), chat_tokenizer()
    prompt = torch.tensor(tokenizer("say 3")["input_ids"])
    sampling = Sampling(max_new_tokens=24, stop_ids=(EOS_ID,), stop_strings=("e",))
    (rows,) = generate(model, [prompt], [16], sampling, tokenizer=tokenizer, generator=torch.Generator().manual_seed(1))
    by_string = 0
    for r in rows:
        text = tokenizer.decode(r.tokens.tolist(), skip_special_tokens=True)
        assert "e" not in text[:-1]  # nothing kept after the stop string
        by_string += text.endswith("e")
        assert (r.finish_reason == STOP) == (text.endswith("e") or r.tokens[-1] == EOS_ID)
    assert by_string > 0


def test_text_prompts_go_through_the_chat_template_and_messages_need_one():
    from rbpipe.demo.policy import build_tokenizer
    from rbpipe.model.chat import PromptEncoder

    tokenizer = chat_tokenizer()
    enc = PromptEncoder(tokenizer).encode("say 4")
    assert enc.text == "<|im_start|>user\nsay 4<|im_end|>\n<|im_start|>assistant\n"
    assert enc.ids.tolist() == tokenizer(enc.text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "system", "content": "be short"}, {"role": "user", "content": "say 4"}]
    assert PromptEncoder(tokenizer).encode(messages).text.startswith("<|im_start|>system\nbe short<|im_end|>")
    assert PromptEncoder(tokenizer, chat_template=False).encode("say 4").text == "say 4"
    for encoder, why in ((PromptEncoder(tokenizer, chat_template=False), "--no-chat-template"),
                         (PromptEncoder(build_tokenizer()), "no chat template")):
        with pytest.raises(ConfigError, match=why) as err:
            encoder.encode(messages)
        assert "\n" not in str(err.value)


def test_rewards_that_raise_hang_or_return_nan_are_failures_and_the_others_go_on():
    from rbpipe.model.rewards import REWARD_ERROR, REWARD_NOT_A_NUMBER, REWARD_TIMEOUT, Failed, call_rewards

    release = threading.Event()
    try:
        out = call_rewards([lambda: 1, lambda: 1 / 0, lambda: release.wait(60), lambda: float("nan"), lambda: 0.5],
                           timeout_s=2.0)
    finally:
        release.set()  # the abandoned call's thread ends
    assert out[0] == 1.0 and out[4] == 0.5
    assert [o.reason for o in out[1:4] if isinstance(o, Failed)] == [REWARD_ERROR, REWARD_TIMEOUT, REWARD_NOT_A_NUMBER]


def test_a_failed_reward_is_counted_and_its_sample_drawn_again_so_the_group_completes(tmp_path):
    from rbpipe.model.generation import stop_token_ids
    from rbpipe.model.rollout import PROMPT_TOO_LONG, Rollouts

    calls = {"n": 0}

    class Task:
        def prompt(self, index):
            return "a" * 100 if index == 9 else f"say {index}"

        def reward(self, prompt, response):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return float(len(response))

    model, tokenizer = chat_model(), chat_tokenizer()
    logged: list[str] = []
    rollouts = Rollouts(Task(), tokenizer, Sampling(max_new_tokens=8, stop_ids=stop_token_ids(tokenizer, model)),
                        max_positions=96, log=logged.append, generator=torch.Generator().manual_seed(0))
    batch = rollouts.run(model, [{"prompt": 1, "samples": 3}, {"prompt": 9, "samples": 2}], collector_id=0,
                         policy_version=0)
    assert len(batch.trajectories) == 3 and {int(t.get("group_id")[0]) for t in batch.trajectories} == {1}
    assert dict(batch.dropped) == {"reward_error": 1, PROMPT_TOO_LONG: 2} and dict(batch.given_up) == {9: 2}
    assert len(logged) == 2 and any("boom" in line for line in logged)
    for t in batch.trajectories:
        assert float(t.get(("next", "reward")).reshape(-1)[0]) == len(t.get(("text", "response")).data)


@pytest.mark.timeout(120)
def test_bad_text_input_is_a_one_line_error_before_anything_is_written(tmp_path, monkeypatch, capsys):

    monkeypatch.chdir(tmp_path)
    model = save_chat_model(tmp_path / "model")
    plain = save_chat_model(tmp_path / "plain", template=False)
    task = tmp_path / "tasks.py"
    task.write_text(TASK_FILE)
    data = tmp_path / "data.jsonl"
    data.write_text('{"q": "say 1", "answer": 1, "bonus": 0}\n')
    cases = [
        (["--prompts", str(data), "--reward", "x.py:f"], "needs --prompt-key"),
        (["--prompts", str(data), "--prompt-key", "q"], "needs --reward"),
        (["--prompts", str(data), "--prompt-key", "nope", "--reward", f"{task}:SayTask", "--model", str(model)],
         "no such column"),
        (["--prompts", str(tmp_path / "none.jsonl"), "--prompt-key", "q", "--reward", "m:f"], "no such file"),
        (["--prompt-key", "q"], "only with --prompts"),
        (["--task", f"{task}:Messages", "--model", str(plain)], "no chat template"),
        (["--task", f"{task}:Messages", "--model", str(model), "--no-chat-template"], "--no-chat-template"),
        (["--task", f"{task}:Long", "--model", str(model)], "exceeds the model's 96 positions"),
        (["--reward-timeout", "0"], "--reward-timeout"),
        (["--top-p", "1.5"], "--top-p"),
    ]
    assert_run_refuses(cases, tmp_path, capsys)


# -- real runs -----------------------------------------------------------------------------------------------------

@pytest.mark.timeout(420)
def test_a_text_task_run_stores_text_that_stops_at_eos_and_counts_failed_rewards(tmp_path):
    model = save_chat_model(tmp_path / "model")
    task_path = tmp_path / "say_task.py"
    task_path.write_text(TASK_FILE)
    markers = tmp_path / "markers"
    markers.mkdir()
    run_dir = tmp_path / "run"
    rc, out, err = run_cli(RUN + ["--run-dir", str(run_dir), "--model", str(model), "--task", f"{task_path}:SayTask",
                                  "--reward-timeout", "2"], timeout=400, env={"MARKERS": str(markers)})
    assert rc == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["learner_steps"] == 3 and summary["conservation_ok"], summary
    assert summary["rejected_reasons"] == {"reward_error": 1, "reward_timeout": 1}, summary
    assert summary["rejected"] == 2 and summary["produced"] == summary["session"]["handed_over"] + 2
    assert err.count("reward_error:") == 1 and err.count("reward_timeout:") == 1, err[-3000:]

    rows = stored(Path(summary["store"]))
    assert len(rows) == summary["written"] >= 3 * 2 * 4
    check_responses(rows, 24)
    task = _import(task_path, "say_task_check").SayTask(seed=0)
    for r in rows:
        assert r["text_prompt"].startswith("<|im_start|>") and r["text_prompt"].endswith("<|im_start|>assistant\n")
        assert r["next_reward"] == pytest.approx(task.reward(r["text_prompt"], r["text_response"]), abs=1e-5)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["truncated_fraction"] <= 1.0 for r in records)

    shown = subprocess.run([sys.executable, "-m", "rbpipe.cli", "inspect", summary["store"], "--group",
                            str(rows[0]["group_id"]), "--texts"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "finish_reason" in shown.stdout and "say " in shown.stdout


@pytest.mark.timeout(420)
def test_prompts_from_a_data_file_reward_with_the_rows_other_columns(tmp_path):
    model = save_chat_model(tmp_path / "model")
    rows_in = [{"q": f"say {i % 10}" if i % 3 else [{"role": "user", "content": f"say {i % 10}"}],
                "answer": i % 10, "bonus": i / 100} for i in range(10, 30)]
    data = tmp_path / "prompts.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{**r, "q": json.dumps(r["q"]) if isinstance(r["q"], list) else r["q"]}
                                         for r in rows_in]), data)
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    reward_path = tmp_path / "my_reward.py"
    reward_path.write_text(REWARD_FILE)
    run_dir = tmp_path / "run"
    rc, out, err = run_cli(RUN + ["--run-dir", str(run_dir), "--model", str(model), "--prompts", str(jsonl),
                                  "--prompt-key", "q", "--reward", f"{reward_path}:score"], timeout=400)
    assert rc == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["learner_steps"] == 3 and summary["conservation_ok"] and summary["rejected"] == 0, summary
    rows = stored(Path(summary["store"]))
    check_responses(rows, 24)
    score = _import(reward_path, "my_reward_check").score
    from rbpipe.model.data_task import DataFileTask

    task = DataFileTask(jsonl, "q", f"{reward_path}:score")
    for r in rows:
        row = task.row(r["group_id"])
        assert ("<|im_start|>user\n" + (row["q"] if isinstance(row["q"], str) else row["q"][0]["content"])
                in r["text_prompt"])
        assert r["next_reward"] == pytest.approx(score(row["q"], r["text_response"], row["answer"], row["bonus"]),
                                                 abs=1e-5)
    assert len({round(r["next_reward"] % 1, 2) for r in rows}) > 1  # bonuses of several rows
    # a Parquet file with the same rows reads the same prompts
    assert DataFileTask(data, "q", f"{reward_path}:score").rows[0]["bonus"] == rows_in[0]["bonus"]


_WORDS = st.text(alphabet="abcdefghij =+,?!\n", max_size=30)


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, 10_000), seed=st.integers(0, 100), before=_WORDS, after=st.sampled_from(["", ".", " !"]))
def test_the_single_digit_task_pays_exactly_for_a_right_final_number(index, seed, before, after):
    """The README's real-model task: one-digit prompts; 1.0 iff the response's last number is the sum (what the
    model says before it, in words, does not matter), so a right sum followed by another number earns nothing."""
    task = SingleDigitAdditionTask(seed=seed)
    prompt = task.prompt(index)
    a, b = (int(x) for x in re.findall(r"\d+", prompt))
    assert 1 <= a <= 9 and 1 <= b <= 9 and prompt == AdditionTask(seed=seed, digits=1).prompt(index)
    assert task.reward(prompt, f"{before}{a + b}{after}") == 1.0
    assert task.reward(prompt, f"{before}{a + b + 1}{after}") == 0.0
    assert task.reward(prompt, f"{a + b} = {a} + {b}") == 0.0
    assert task.reward("no question here", f"{a + b}") == 0.0
