"""``score_batch`` runs its calls on a pool of threads (not one thread a call, which cost more than a cheap reward):
each score lands at its index, at most ``workers`` calls run at once, a call past the limit is abandoned and its
slot goes to a new thread while the abandoned one stops when it returns (no extra concurrency afterwards)."""

from __future__ import annotations

import threading
import time

from megadare.rewards.scoring import score_batch


class Recorder:
    """A reward that records which thread ran each call and how many calls overlapped."""

    def __init__(self, hang: float = 0.0, work: float = 0.02):
        self.lock, self.threads, self.now, self.peak, self.hang = threading.Lock(), set(), 0, 0, hang
        self.work = work
        self.order: list[str] = []  # "hang", "returned" (the hung call came back), "x"
        self.hung_thread, self.ran_after_return = None, []

    def __call__(self, response: str, record: dict) -> float:
        me = threading.current_thread()
        with self.lock:
            self.threads.add(me)
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.order.append(response)
            if "returned" in self.order:
                self.ran_after_return.append(me)
        try:
            if response == "hang":
                self.hung_thread = me
                time.sleep(self.hang)
                with self.lock:
                    self.order.append("returned")
            else:
                time.sleep(self.work)
            return float(record["score"])
        finally:
            with self.lock:
                self.now -= 1


def test_scores_land_in_order_on_a_bounded_pool_of_threads():
    reward = Recorder()
    records = [{"score": i / 10} for i in range(40)]
    scores, stats = score_batch(reward, ["x"] * 40, records, workers=3)
    assert scores == [i / 10 for i in range(40)] and stats.errors == stats.timeouts == 0
    assert reward.peak <= 3
    assert len(reward.threads) <= 3  # a thread per call would be 40


def test_a_timed_out_call_hands_its_slot_on_and_its_thread_stops():
    """The hung call returns while calls are still waiting (60 x 0.1 s on two slots outlast its 2 s): its thread
    takes none of them. A normal call has 0.9 s of slack before the 1 s limit, so a loaded machine's late thread
    wake-ups do not time it out."""
    reward = Recorder(hang=2.0, work=0.1)
    responses = ["x", "hang"] + ["x"] * 60
    scores, stats = score_batch(reward, responses, [{"score": 1.0}] * 62, workers=2, timeout_s=1.0)
    assert stats.timeouts == 1 and stats.failed == {1: "TimeoutError: the reward call ran past 1s"}
    assert scores == [1.0, 0.0] + [1.0] * 60  # the other calls ran on the slot handed on
    hung = reward.order.index("hang")
    assert reward.order.index("returned") > hung
    assert all(thread is not reward.hung_thread for thread in reward.ran_after_return)
    assert reward.peak <= 3  # two slots, plus the abandoned call while it hung
