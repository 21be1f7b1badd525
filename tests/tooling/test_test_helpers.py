"""The suite's own helpers: run_in_threads re-raises a worker's error (a bare Thread loses it)."""
import threading

import pytest

from tests.helpers import run_in_threads


def test_run_in_threads_returns_results_in_order_and_runs_them_at_once():
    barrier = threading.Barrier(3)   # deadlocks unless the three run at the same time

    def work(i):
        barrier.wait(timeout=30)
        return i * i
    assert run_in_threads([lambda i=i: work(i) for i in range(3)]) == [0, 1, 4]
    assert run_in_threads([]) == []


def test_run_in_threads_reraises_a_workers_error_after_all_finished():
    done = []

    def slow():
        barrier.wait(timeout=30)
        done.append("slow")

    def bad():
        barrier.wait(timeout=30)
        raise KeyError("worker 1")
    barrier = threading.Barrier(2)
    with pytest.raises(KeyError, match="worker 1"):
        run_in_threads([bad, slow])
    assert done == ["slow"]
