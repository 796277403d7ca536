"""dht.once: one warning per cause, for a bounded number of causes."""

from __future__ import annotations

import threading

from dht.once import OncePer


def test_first_is_true_once_per_key_and_never_past_the_capacity():
    once = OncePer(2)
    assert once.first("a") and not once.first("a")
    assert once.first("b")
    assert not once.first("c"), "past the capacity: forged causes must not grow memory or the log"


def test_threads_see_each_key_first_exactly_once():
    once, firsts = OncePer(1000), []
    threads = [
        threading.Thread(target=lambda: firsts.extend(k for k in range(100) if once.first(k))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(firsts) == list(range(100))
