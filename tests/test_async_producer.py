"""The producer thread (rollout/async_producer.py) with a scripted worker and client, no server: slots arrive in
prompt order, the weights sent before sampling carry their version, a hung worker is killed and restarted, a
server grouprl did not start is not restarted, and a refused request is an error (none of them hangs)."""

import threading
import time
from contextlib import contextmanager

import pytest

from grouprl.core.types import Completion
from grouprl.generation.workers import WorkerDied
from grouprl.rollout.async_producer import Limits, Producer
from grouprl.rollout.async_slots import SlotBook


class Worker:
    restartable = True

    def __init__(self):
        self.code, self.version, self.restarts, self.killed = None, 0, 0, 0

    def exit_code(self):
        return self.code

    def describe(self):
        return "the scripted worker"

    def kill(self):
        self.killed += 1
        self.code = -9

    def restart(self):
        self.restarts += 1
        self.code = None


class Client:
    """Answers with the version it was last sent; `hang` makes both requests and /health block."""

    is_grouprl = True

    def __init__(self):
        self.version, self.sent, self.hang, self.refuse = 0, [], threading.Event(), False
        self.local = threading.local()

    def send_weights(self, weights, version):
        self.sent.append(version)
        self.version = version

    @contextmanager
    def versions_seen(self):
        self.local.seen = []
        yield self.local.seen

    def health(self, timeout):
        if self.hang.is_set():
            time.sleep(timeout)
            raise TimeoutError("no answer")
        return {}

    def sample(self, slot):
        while self.hang.is_set():
            time.sleep(0.05)
        if self.refuse:
            raise ValueError("the server refused the request (400)")
        self.local.seen.append(self.version)
        return [Completion(0, [slot.number], "", "stop")] * 2


def producer(worker, client, *, max_staleness=1, heartbeat=60.0):
    book = SlotBook(max_staleness, 1.0)
    book.start(0)
    numbers = iter(range(1000))

    def draw():
        n = next(numbers)
        return [n], [{"prompt": str(n)}]

    made = Producer(
        book,
        draw=draw,
        sample=client.sample,
        backend=client,
        worker=worker,
        limits=Limits(in_flight=2, queue=4, heartbeat_s=heartbeat),
        completions_per_slot=2,
    )
    return made


def test_slots_come_in_order_tagged_with_the_weights_that_sampled_them():
    worker, client = Worker(), Client()
    made = producer(worker, client, max_staleness=0)
    try:
        for step in range(4):
            finished, report = made.take(step)
            assert finished.slot.number == step and finished.version == step and report["staleness"] == 0
            made.publish(step + 1, [("w", None)])
        deadline = time.monotonic() + 10
        while client.sent != [1, 2, 3, 4] and time.monotonic() < deadline:  # the last one goes out in the background
            time.sleep(0.05)
        assert client.sent == [1, 2, 3, 4]
    finally:
        made.stop()


@pytest.mark.e2e
def test_a_hung_worker_is_killed_and_restarted_then_a_second_hang_stops_the_run():
    worker, client = Worker(), Client()
    client.hang.set()  # hung from the first request, so no slot is finished before the restart
    threading.Timer(3.0, client.hang.clear).start()  # the restarted worker answers again
    started = time.monotonic()
    made = producer(worker, client, heartbeat=1.0)
    try:
        finished, _ = made.take(0)
        assert finished.slot.number == 0 and worker.restarts == 1 and time.monotonic() - started < 30
        client.hang.set()
        with pytest.raises(WorkerDied, match="has not answered for .* after it was restarted once"):
            for _ in range(10):  # slots drawn ahead before the second hang come first
                made.take(0)
    finally:
        client.hang.clear()
        made.stop()


def test_a_server_grouprl_did_not_start_is_not_restarted():
    worker, client = Worker(), Client()
    worker.restartable = False
    worker.describe = lambda: "the generation server at http://elsewhere:8000"
    made = producer(worker, client)
    try:
        made.take(0)
        worker.code = 1
        with pytest.raises(WorkerDied, match="the generation server at http://elsewhere:8000 exited with code 1"):
            for _ in range(10):
                made.take(0)
    finally:
        made.stop()


def test_a_refused_request_is_raised_not_retried():
    worker, client = Worker(), Client()
    client.refuse = True
    made = producer(worker, client)
    try:
        with pytest.raises(ValueError, match="refused the request"):
            made.take(0)
    finally:
        made.stop()
