"""bench/routing.py's routers re-implement GIE's endpoint-picker scoring and add a rendezvous-hash
tie-break; their rules are checked here on hand-built pod views, and the parser on a real /metrics
exposition."""

from __future__ import annotations

import random

from prometheus_client import generate_latest

from bench import routing
from inference_service.engine.in_process import EngineStats
from inference_service.frontend.metrics import EngineCollector, build_registry


def pod(running=(), waiting=(), max_lora=2, queue=0, kv=0.0, resident=(), name="pod") -> object:
    return routing.Replica(name, "http://x", None, max_lora, set(running), set(waiting), queue, kv,
                           set(resident))


def test_lora_affinity_rules_in_gie_order() -> None:
    assert routing.lora_affinity_score(pod(running={"a", "b"}), "a") == 1.0  # active
    assert routing.lora_affinity_score(pod(running={"b"}), "a") == 0.8  # room for one more
    assert routing.lora_affinity_score(pod(running={"b"}, waiting={"a"}), "a") == 0.6  # full, a waiting
    assert routing.lora_affinity_score(pod(running={"b", "c"}), "a") == 0.0  # full
    # Residency counts only in the residency-aware variant.
    assert routing.lora_affinity_score(pod(running={"b", "c"}, resident={"a"}), "a") == 0.0
    assert routing.lora_affinity_score(pod(running={"b", "c"}, resident={"a"}), "a", residency=True) == 1.0


def test_queue_scores_normalised_and_picker() -> None:
    pods = [pod(queue=4), pod(queue=0), pod(queue=2)]
    assert routing.queue_scores(pods) == [0.0, 1.0, 0.5]
    assert routing.queue_scores([pod(queue=3), pod(queue=3)]) == [1.0, 1.0]
    with_a, empty = pod(running={"a", "b"}), pod()
    pick = routing.affinity_router([with_a, empty], random.Random(0))
    assert pick("a") is with_a  # 1.0 + 1 + 1 beats 0.8 + 1 + 1
    assert pick("c") is empty  # with_a is full: 0 + 1 + 1 against 0.8 + 1 + 1
    with_a.queue = 1  # a longer queue outweighs affinity: 1.0 + 0 + 1 < 0.8 + 1 + 1
    assert pick("a") is empty


def test_parse_view_of_real_exposition() -> None:
    registry, _ = build_registry()
    stats = EngineStats(max_lora=4, running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",),
                        requests_waiting={"queued": 3}, kv_cache_usage=0.25, updated_at=1.7e9)
    registry.register(EngineCollector(lambda: stats))
    view = routing.parse_view(generate_latest(registry).decode())
    assert (view["max_lora"], view["running"], view["waiting"], view["queue"], view["kv"]) == \
        (4, {"a", "b"}, {"c"}, 3, 0.25)


def test_rendezvous_tie_break_is_deterministic_sticky_and_spreads() -> None:
    pods = [pod(name=f"replica-{i}", max_lora=4) for i in range(4)]
    adapters = [f"lora-{k:02d}" for k in range(32)]
    homes = {a: routing.rendezvous_rank(a, pods)[0].name for a in adapters}
    # The same home whatever the order the pods are listed in, and from a fresh router.
    assert {a: routing.rendezvous_rank(a, pods[::-1])[0].name for a in adapters} == homes
    pick = routing.affinity_router(pods, random.Random(1), tie_break="rendezvous")
    assert all(pick(a).name == homes[a] for a in adapters for _ in range(3))  # all tied: the home wins
    # Adapters spread over every pod (32 adapters, 4 pods: none gets more than half).
    per_pod = [list(homes.values()).count(r.name) for r in pods]
    assert min(per_pod) > 0 and max(per_pod) <= 16, per_pod
    # Removing a pod moves only the adapters that lived there.
    gone = pods[0].name
    rest = {a: routing.rendezvous_rank(a, pods[1:])[0].name for a in adapters}
    assert all(rest[a] == homes[a] for a in adapters if homes[a] != gone)
    # Only a tie defers to the home: a better score elsewhere still wins.
    home = next(r for r in pods if r.name == homes["lora-00"])
    other = next(r for r in pods if r is not home)
    other.running = {"lora-00"}
    assert pick("lora-00") is other
    other.running, home.queue = set(), 2  # a longer queue at home sends it away too
    assert pick("lora-00") is not home


def test_random_tie_break_is_gies() -> None:
    pods = [pod(name=f"replica-{i}", max_lora=4) for i in range(4)]
    pick = routing.affinity_router(pods, random.Random(1))
    assert len({pick("lora-00").name for _ in range(50)}) > 1  # GIE's picker: ties at random


def test_load_bound_spills_a_hot_pod_but_keeps_affinity_otherwise() -> None:
    hot, idle = pod(name="replica-0", running={"a"}, resident={"a"}), pod(name="replica-1")
    pods = [hot, idle]
    pick = routing.affinity_router(pods, random.Random(0), residency=True, tie_break="rendezvous",
                                   load_bound=(1.25, 2))
    hot.in_flight = 1
    assert pick("a") is hot  # one in flight is under the floor of two: affinity wins
    hot.in_flight = 2
    assert pick("a") is idle  # bound max(2, ceil(1.25 * 3 / 2)) = 2: the hot pod is full
    idle.in_flight = 4
    assert pick("a") is hot  # now the mean is higher: ceil(1.25 * 7 / 2) = 5 > 2
    assert routing.within_load_bound(pods, 1.25, 2) == pods
    hot.in_flight, idle.in_flight = 6, 0
    assert routing.within_load_bound(pods, 1.25, 2) == [idle]  # ceil(1.25 * 7 / 2) = 5 <= 6


HALVES = ("adapter loads", "TTFT p99")


def _result(loads: float, ttft_s: float) -> object:
    return routing.Result([ttft_s] * 10, 320, 1.0, loads, [5, 5])


def test_report_prints_both_halves_and_no_result_when_either_fails(capsys) -> None:
    cases = [  # (affinity's loads, its TTFT) against round-robin's 100 loads and 1 s: exit status, failed halves
        ((30, 0.9), 0, []),
        ((30, 1.2), 1, ["TTFT p99"]),  # fewer loads bought with a worse tail: no RESULT
        ((60, 0.9), 1, ["adapter loads"]),
        ((60, 1.2), 1, ["adapter loads", "TTFT p99"]),
    ]
    for (loads, ttft), status, failed in cases:
        total = {"round-robin": _result(100, 1.0), "affinity": _result(loads, ttft)}
        assert routing.report(total, ["round-robin", "affinity"]) == status
        lines = capsys.readouterr().out.splitlines()
        stated = [ln for ln in lines if ln.startswith("affinity: ")]  # both halves, always, each judged
        assert [ln.startswith(f"affinity: {h}") for h, ln in zip(HALVES, stated, strict=True)] == [True, True]
        assert all(ln.endswith(("held", "FAILED")) for ln in stated)
        assert [h for h, ln in zip(HALVES, stated, strict=True) if ln.endswith("FAILED")] == failed
        assert lines[-1].startswith("RESULT affinity_loads_vs_roundrobin=") == (status == 0)
        if failed:
            assert lines[-1].startswith("no RESULT: affinity failed") and all(h in lines[-1] for h in failed)
