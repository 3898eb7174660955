"""The isolation harness's own checks can fail: a victim beside no attack passes, and one beside a
real stall of the server (the front-end process stopped with SIGSTOP for longer than the victim's
whole solo run) fails on its time, not on its tokens."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import SLACK_S, SLOWDOWN_LIMIT, solo_run, victim_beside

VICTIM_TOKENS = 384


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[InferenceServer]:
    s = start_inference_server(["--max-new-tokens-limit", "1024"], log_dir=tmp_path_factory.mktemp("iso-harness"))
    yield s
    s.stop()


def test_a_victim_beside_no_attack_passes(server):
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    with victim_beside(server, base):
        pass


def test_a_victim_stalled_by_the_server_fails_on_its_time(server):
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    stall = SLOWDOWN_LIMIT * base.seconds + SLACK_S  # the whole budget, on top of the victim's own time
    with pytest.raises(AssertionError, match="beside the attack"), victim_beside(server, base):
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(stall)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
