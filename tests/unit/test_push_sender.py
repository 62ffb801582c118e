"""The push sender: pushes beside backward go on its thread, in order; after a failed one the rest
are not sent; a push with nothing to run beside, and nothing queued before it, goes on the caller's."""

from __future__ import annotations

import threading

import pytest

from psflow.train.sender import PushSender

pytestmark = pytest.mark.timeout(30)


def test_pushes_beside_compute_run_on_the_senders_thread_in_order_and_a_last_one_after_them():
    sender, ran = PushSender(), []
    release = threading.Event()

    def send(shard: int, hold: bool = False):
        def run() -> None:
            if hold:
                assert release.wait(10)
            ran.append((shard, threading.current_thread() is threading.main_thread()))
        return run

    sender.submit(2, send(2, hold=True))
    sender.submit(1, send(1))
    sender.submit(0, send(0), beside_compute=False)  # queued behind 2 and 1, which are not done
    release.set()
    assert sender.join() == (set(), None)
    assert ran == [(2, False), (1, False), (0, False)]
    sender.submit(0, send(0), beside_compute=False)  # nothing queued: sent at once, here
    assert ran[-1] == (0, True) and sender.join() == (set(), None)
    sender.close()


def test_after_a_failed_push_the_later_ones_are_not_sent_and_join_names_them_all():
    sender, ran = PushSender(), []

    def fail() -> None:
        raise ConnectionError("ps:2 lost")

    sender.submit(2, fail)
    sender.submit(1, lambda: ran.append(1))
    sender.submit(0, lambda: ran.append(0), beside_compute=False)
    failed, error = sender.join()
    assert failed == {2, 1, 0} and isinstance(error, ConnectionError) and ran == []
    sender.submit(0, lambda: ran.append(0))  # the next step sends again
    assert sender.join() == (set(), None) and ran == [0]
    sender.close()


def test_unthreaded_sends_on_the_callers_thread():
    sender, where = PushSender(threaded=False), []
    sender.submit(1, lambda: where.append(threading.current_thread() is threading.main_thread()))
    assert where == [True] and sender.join() == (set(), None)
