"""The worker's model thread: calls submitted from gRPC threads run on the thread that loaded
the model."""

from __future__ import annotations

import threading

import pytest

from gpu_worker.server import ModelThread, WorkerStopping


def test_submitted_calls_run_on_the_running_thread_and_keep_their_errors() -> None:
    model = ModelThread()
    stop = threading.Event()
    seen: list[str] = []
    results: list[object] = []

    def client() -> None:
        results.append(model.submit(lambda: threading.current_thread().name).result())
        with pytest.raises(ZeroDivisionError):
            model.submit(lambda: 1 // 0).result()
        results.append(model.submit(lambda: 42).result())
        stop.set()

    t = threading.Thread(target=client, name="grpc")
    t.start()
    seen.append(threading.current_thread().name)
    model.run(stopped=stop.is_set, poll_s=0.01)
    t.join()
    assert results == [seen[0], 42]  # the first call ran here, not on the client's thread


def test_an_interrupt_stops_the_thread_and_fails_every_waiting_call() -> None:
    model = ModelThread()
    queued = []

    def interrupted() -> None:
        queued.append(model.submit(lambda: "never runs"))  # queued behind this call
        raise KeyboardInterrupt

    first = model.submit(interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.run(stopped=lambda: False, poll_s=0.01)
    for future in (first, *queued, model.submit(lambda: "too late")):
        with pytest.raises(WorkerStopping):
            future.result(timeout=1)
