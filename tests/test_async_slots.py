"""The book of asynchronous generations (rollout/async_slots.py), without threads or a worker: the order slots
are taken in, what is dropped as stale and requested again, what the worker may sample ahead, what resuming keeps."""

from grouprl.core.types import Completion
from grouprl.rollout.async_slots import Finished, Slot, SlotBook


def slot(number, groups=2):
    return Slot(number, [10 * number + g for g in range(groups)], [{"prompt": f"p{number}.{g}"} for g in range(groups)])


def finished(number, version):
    return Finished(slot(number), [Completion(0, [1], "", "stop")] * 4, version)


def test_slots_are_taken_in_order_and_a_stale_one_is_dropped_and_requested_again():
    book = SlotBook(max_staleness=1, steps_per_generation=1.0)
    book.start(0)
    book.finish(finished(1, 0))
    assert book.take() is None  # slot 0 comes first, even though slot 1 is ready
    book.finish(finished(0, 0))
    taken, staleness = book.take()
    assert taken.slot.number == 0 and staleness == 0
    book.trainer_version = 2  # two updates later, slot 1 (sampled at version 0) is 2 versions old
    assert book.take() is None
    assert book.dropped_groups == 2 and [s.number for s in book.waiting] == [1]  # back in line, nothing skipped
    book.finish(finished(1, 2))
    taken, staleness = book.take()
    assert taken.slot.number == 1 and staleness == 0 and book.next_take == 2


def test_drop_stale_counts_only_slots_too_old_for_the_current_version():
    book = SlotBook(max_staleness=2, steps_per_generation=1.0)
    book.start(5)
    book.finish(finished(0, 2))
    book.finish(finished(1, 3))
    assert book.drop_stale() == 1 and sorted(book.finished) == [1] and book.dropped_groups == 2


def test_the_worker_samples_ahead_at_most_max_staleness_versions():
    book = SlotBook(max_staleness=0, steps_per_generation=1.0)
    book.start(3)
    assert book.expected_version(0) == 3 and book.may_request(0, worker_version=3)
    assert book.expected_version(1) == 4 and not book.may_request(1, worker_version=3)  # waits for version 4
    assert book.may_request(1, worker_version=4)
    # two optimizer steps per generation: slot 1 will be trained from version 5
    book = SlotBook(max_staleness=2, steps_per_generation=2.0)
    book.start(3)
    assert [book.expected_version(k) for k in range(3)] == [3, 5, 7]
    assert book.may_request(1, worker_version=3) and not book.may_request(2, worker_version=3)
    # while the trainer waits for a slot, it is trained at the trainer's version, whatever the estimate said
    book.next_take, book.last_take_version, book.trainer_waiting, book.trainer_version = 2, 3.0, True, 4
    assert book.expected_version(2) == 4


def test_a_checkpoint_keeps_every_slot_drawn_and_not_taken_in_order():
    book = SlotBook(max_staleness=1, steps_per_generation=1.0, next_number=5, next_take=1)
    book.add(slot(4))
    book.requested[2] = slot(2)
    book.finish(finished(3, 0))
    book.add(slot(1))
    state = book.state_dict()
    assert [number for number, *_ in state["slots"]] == [1, 2, 3, 4]
    resumed = SlotBook(max_staleness=1, steps_per_generation=1.0)
    resumed.load_state_dict(state)
    assert [s.number for s in resumed.waiting] == [1, 2, 3, 4] and not resumed.requested and not resumed.finished
    assert (resumed.next_take, resumed.next_number) == (1, 5)
    assert resumed.waiting[1].indices == [20, 21]
