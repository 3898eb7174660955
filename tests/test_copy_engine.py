"""The CPU copy engine copies between forward passes only, a piece (one layer) at a time."""

from __future__ import annotations

import threading

from inference_service.device import ThreadCopyEngine
from inference_service.lora.mem_pool import SlotCopy


def test_copies_wait_while_a_forward_pass_runs():
    engine = ThreadCopyEngine()
    ran: list[int] = []
    first_done = threading.Event()

    def first() -> None:
        ran.append(1)
        first_done.set()

    copy = SlotCopy([first, lambda: ran.append(2)])
    with engine.computing():
        handle = engine.submit(copy)
        assert not first_done.wait(0.3), "no piece starts during a forward pass"
    assert first_done.wait(5)
    handle.wait()
    assert ran == [1, 2] and handle.done()
    engine.close()


def test_a_forward_pass_holds_back_the_rest_of_a_copy():
    engine = ThreadCopyEngine()
    ran: list[int] = []
    in_first, release_first = threading.Event(), threading.Event()

    def first() -> None:
        in_first.set()
        release_first.wait(5)
        ran.append(1)

    handle = engine.submit(SlotCopy([first, lambda: ran.append(2)]))
    assert in_first.wait(5)
    with engine.computing():  # begins while the first piece is running
        release_first.set()
        threading.Event().wait(0.3)
        assert ran == [1] and not handle.done(), "the second piece waits for the pass to end"
    handle.wait()
    assert ran == [1, 2]
    engine.close()
