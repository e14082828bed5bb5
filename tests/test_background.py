"""The learner's bookkeeping thread: jobs in order, copies that training cannot change, failures not lost."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rbpipe.tracking.background import BackgroundJobs, snapshot


def test_jobs_run_in_submission_order_and_close_waits_for_the_queued_ones():
    done = []
    release = threading.Event()  # the jobs wait for it: "submit did not wait" holds however slow this thread is

    def slow(i):
        assert release.wait(30)
        done.append(i)

    jobs = BackgroundJobs()
    for i in range(5):
        jobs.submit(slow, i)
    assert done == []  # submit did not wait for the writes
    release.set()
    jobs.close()
    assert done == [0, 1, 2, 3, 4]


def test_jobs_run_beside_the_submitter_on_one_named_thread():
    names = []
    with BackgroundJobs(name="bk-test") as jobs:
        jobs.submit(lambda: names.append(threading.current_thread().name))
        jobs.drain()
    assert names == ["bk-test"]


def test_a_failed_job_skips_the_later_ones_and_is_raised_in_the_submitting_thread():
    done = []

    def fail():
        raise OSError("disk full")

    jobs = BackgroundJobs()
    jobs.submit(done.append, 1)
    jobs.submit(fail)
    jobs.submit(done.append, 2)  # would otherwise land after a lost write it depends on
    with pytest.raises(OSError, match="disk full"):
        jobs.drain()
    jobs.close()
    assert done == [1]


def test_an_error_in_the_with_block_still_finishes_the_queued_jobs_and_keeps_that_error():
    done = []
    with pytest.raises(KeyError):
        with BackgroundJobs() as jobs:
            jobs.submit(lambda: (time.sleep(0.05), done.append("checkpoint")))
            raise KeyError("stop")
    assert done == ["checkpoint"]


def test_submit_after_close_is_refused():
    jobs = BackgroundJobs()
    jobs.close()
    with pytest.raises(RuntimeError, match="closed"):
        jobs.submit(print)


def test_a_snapshot_keeps_the_state_of_when_it_was_taken():
    """What a checkpoint job saves is the model at its step, even though training updates it in place."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1, "done": [1, 2]}
    expected = {"weight": model.weight.detach().clone(),
                "exp_avg": optimizer.state[model.weight]["exp_avg"].clone()}
    copied = snapshot(state)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # updates the weights and Adam's moments in place
    assert not torch.equal(model.weight, expected["weight"])
    assert torch.equal(copied["model"]["weight"], expected["weight"])
    assert torch.equal(copied["optimizer"]["state"][0]["exp_avg"], expected["exp_avg"])
    assert copied["step"] == 1 and copied["done"] == [1, 2]
    assert copied["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
