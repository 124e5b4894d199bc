"""The producer of asynchronous generations: a background thread of the trainer's main process.

    loop:  send the newest published weights, if any (they carry the trainer's version)
           drop finished slots already too stale; pick the next slot the worker may sample now
               (async_slots.py: in order, dropped ones first; within max_inflight / queue_maxsize)
           hand it to a request thread: sample every group whole on the worker, tagged with the weight
               version the worker reports, into the book's finished slots
    take (trainer thread): wait for the next slot in order, fresh enough (a stale one is regenerated)

The worker is watched from both threads (`watch`): a process that exited, or a worker that has not answered
for heartbeat_stale_after_s (it is killed), is restarted once from its start-up weights and sent the newest
weights; requests lost with it are made again. A second death, or a server grouprl did not start, stops
training with an error naming the worker (and its exit code): the trainer never waits forever.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from grouprl.core.types import Completion
from grouprl.generation.workers import WorkerDied
from grouprl.rollout.async_slots import Finished, Slot, SlotBook


@dataclass(frozen=True)
class Limits:
    in_flight: int  # completions requested and not finished (at least one slot)
    queue: int  # completions finished or requested, not yet taken (at least one slot)
    heartbeat_s: float
    restarts: int = 1


class Producer:
    """Keeps the worker sampling the next slots while the trainer trains; `take` hands them over in order."""

    def __init__(
        self,
        book: SlotBook,
        *,
        draw: Callable[[], tuple[list[int], list[dict]]],
        sample: Callable[[Slot], list[Completion]],
        backend: Any,  # RemoteGenerator-like: send_weights(weights, version), versions_seen(), health(timeout)
        worker: Any,  # generation.workers.LocalWorker / ServerWorker
        limits: Limits,
        completions_per_slot: int,
    ):
        self.book, self.draw, self.sample, self.backend, self.worker = book, draw, sample, backend, worker
        self.limits, self.per_slot = limits, completions_per_slot
        self.cond = threading.Condition()
        self.watch_lock = threading.Lock()
        self.epoch = 0  # worker restarts so far; a request from an older epoch died with its worker
        self.latest: Optional[tuple[int, list]] = None  # the newest published (version, weights)
        self.unsent = False
        self.worker_version = book.trainer_version  # the version the worker samples with now
        self.exact_versions = bool(getattr(backend, "is_grouprl", False))  # the server tags each answer
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.restarting = False  # a dead worker is being replaced: failing requests are lost, not errors
        self.last_answer = time.monotonic()
        self.generator_wait = 0.0  # seconds the worker sat idle (nothing it may sample) since the last take
        self.pool = ThreadPoolExecutor(max(1, limits.in_flight // completions_per_slot), "grouprl-request")
        self.thread = threading.Thread(target=self._run, name="grouprl-producer", daemon=True)

    # ---- trainer side ---------------------------------------------------------------------------

    def publish(self, version: int, weights: list) -> None:
        """New weights for the worker (a snapshot the trainer will not change), sent before the next request."""
        with self.cond:
            self.latest, self.unsent = (version, weights), True
            self.book.trainer_version = max(self.book.trainer_version, version)
            self.cond.notify_all()

    def take(self, trainer_version: int) -> tuple[Finished, dict[str, float]]:
        """The next slot in prompt order, at most max_staleness versions old, and the numbers logged with it.

        The first take starts the producer: by then the worker holds the policy's weights (a server is sent them
        first) and the trainer's generation_backend is the worker's client, which a rollout_func samples through."""
        if self.thread.ident is None:
            self.thread.start()
        started = time.monotonic()
        with self.cond:
            self.book.trainer_version = max(self.book.trainer_version, trainer_version)
            self.book.trainer_waiting = True
            self.cond.notify_all()
            try:
                while (taken := self.book.take()) is None:
                    self._raise_if_failed()
                    self.cond.notify_all()  # a dropped slot is to be requested again
                    self.cond.wait(timeout=1.0)
                    self.cond.release()
                    try:
                        self.watch()
                    finally:
                        self.cond.acquire()
            finally:
                self.book.trainer_waiting = False
            finished, staleness = taken
            report = {
                "staleness": float(staleness),
                "dropped_groups": float(self.book.dropped_groups),
                "queue_size": float(self.book.completions_waiting()),
                "trainer_wait_s": time.monotonic() - started,
                "generator_wait_s": self.generator_wait,
            }
            self.book.dropped_groups, self.generator_wait = 0, 0.0
            self.cond.notify_all()  # room in the queue
        return finished, report

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive():
            raise RuntimeError("the asynchronous generation thread stopped without an error (was training stopped?).")

    # ---- the worker's health --------------------------------------------------------------------

    def watch(self) -> None:
        """Restart a worker that exited or stopped answering (once); otherwise raise WorkerDied naming it."""
        with self.watch_lock:
            if self.error is not None:
                raise self.error  # the first thread to find the worker dead said why
            code = self.worker.exit_code()
            silent = time.monotonic() - self.last_answer
            if code is None and silent > min(5.0, self.limits.heartbeat_s / 4):
                try:
                    self.backend.health(timeout=min(5.0, self.limits.heartbeat_s))
                    self.last_answer, silent = time.monotonic(), 0.0
                except OSError:
                    silent = time.monotonic() - self.last_answer
            if code is None and silent <= self.limits.heartbeat_s:
                return
            what = (
                f"exited with code {code}"
                if code is not None
                else f"has not answered for {silent:.0f}s (heartbeat_stale_after_s={self.limits.heartbeat_s:g})"
            )
            if not self.worker.restartable or self.epoch >= self.limits.restarts:
                self.worker.kill()
                again = " after it was restarted once" if self.epoch else ""
                raise WorkerDied(f"{self.worker.describe()} {what}{again}; training stops.")
            with self.cond:
                self.restarting = True
            dead = self.worker.describe()
            try:
                self.worker.kill()
                self.worker.restart()
            except WorkerDied as err:
                raise WorkerDied(f"{dead} {what}; it was restarted once, and then {err}") from None
            finally:
                with self.cond:
                    self.restarting = False
            with self.cond:
                self.epoch += 1
                self.last_answer = time.monotonic()
                self.worker_version, self.unsent = self.worker.version, self.latest is not None
                for slot in list(self.book.requested.values()):  # lost with the old process
                    self.book.fail(slot)
                self.cond.notify_all()

    # ---- producer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self.worker.exit_code() is not None:
                    self.watch()
                with self.cond:
                    if self.stopping:
                        return
                    send = self.latest if self.unsent and (self.exact_versions or not self.book.requested) else None
                    self.unsent = self.unsent and send is None
                if send is not None:
                    self._send(*send)
                    continue
                with self.cond:
                    if self.book.drop_stale():
                        self.cond.notify_all()
                    slot = self._next_slot()
                    if slot is None:
                        idle = not self.book.requested
                        waited = time.monotonic()
                        self.cond.wait(timeout=1.0)
                        self.generator_wait += (time.monotonic() - waited) if idle else 0.0
                    else:
                        self.book.requested[slot.number] = slot
                        epoch, version = self.epoch, self.worker_version
                if slot is None:
                    self.watch()
                else:
                    self.pool.submit(self._request, slot, epoch, version)
        except BaseException as err:  # handed to the trainer, which raises it from take()
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _next_slot(self) -> Optional[Slot]:
        """The next slot the worker may sample now (drawing a new one when none waits), or None."""
        book, per_slot = self.book, self.per_slot
        if self.unsent and not self.exact_versions:
            return None  # a server that does not tag its answers gets the weights between requests
        in_flight = len(book.requested) * per_slot
        held = in_flight + book.completions_waiting()
        if book.requested and in_flight + per_slot > self.limits.in_flight:
            return None
        if (book.requested or book.finished) and held + per_slot > self.limits.queue:
            return None
        if not book.waiting:
            if not book.may_request(book.next_number, self.worker_version):
                return None
            indices, rows = self.draw()
            book.add(Slot(book.next_number, indices, rows))
            book.next_number += 1
        slot = book.waiting[0]
        if not book.may_request(slot.number, self.worker_version):
            return None
        book.waiting.pop(0)
        return slot

    def _send(self, version: int, weights: list) -> None:
        epoch = self.epoch
        try:
            self.backend.send_weights(weights, version)
        except OSError:
            self.watch()  # a dead worker is restarted (and sent these weights again) or the run stops
            if self.epoch == epoch:
                raise
            return
        with self.cond:
            if self.epoch == epoch:
                self.worker_version, self.last_answer = version, time.monotonic()
            self.cond.notify_all()

    def _request(self, slot: Slot, epoch: int, version: int) -> None:
        try:
            with self.backend.versions_seen() as seen:
                completions = self.sample(slot)
            known = [v for v in seen if v is not None] if self.exact_versions else []
            finished = Finished(slot, completions, min(known) if known else version)
            with self.cond:
                self.last_answer = time.monotonic()
                if slot.number in self.book.requested:  # else it was lost with a restarted worker, and re-queued
                    self.book.finish(finished)
                self.cond.notify_all()
        except BaseException as err:
            with self.cond:
                if self._still_running(err, epoch):
                    self.error = err  # the worker lives: a bug or a refused request, raised by take()
                elif self.epoch == epoch and slot.number in self.book.requested:
                    self.book.fail(slot)  # lost with the worker: requested again once it is back
                self.cond.notify_all()  # (a request of an older worker was re-queued by its restart)

    def _still_running(self, err: BaseException, epoch: int) -> bool:
        """Whether the worker of `epoch` outlived a failed request (held: self.cond). A killed process closes its
        connections a moment before it can be reaped, so a connection error waits (at most 2 s, the lock
        released) for the exit to show; a restart meanwhile means it did not."""
        deadline = time.monotonic() + (2.0 if isinstance(err, OSError) else 0.0)
        while self.epoch == epoch and not self.restarting and self.worker.exit_code() is None:
            if time.monotonic() >= deadline:
                return True
            self.cond.wait(timeout=0.05)
        return False
