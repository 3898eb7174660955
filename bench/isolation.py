"""How much each isolation attack slows another tenant's stream: the speed half of the isolation
tests (tests/test_isolation_*.py assert behaviour only: the victim's exact tokens, a stall bound,
the attacker's status code, no leak).

One real `loraplex-inference` subprocess (builtin:tiny); the victim is the harness's
(harness/isolation.py): a greedy 384-token stream on a resident adapter, repeated back to back in a
process of its own. For each attack, in each round: the victim alone for WINDOW seconds, then beside
the attack repeated for WINDOW seconds; its slowdown is the mean time of its runs beside the attack
over the median of its runs alone just before. The attacks' order alternates between rounds, so a
drift in the host's speed does not fall on one attack.

    .venv/bin/python -m bench.isolation [--rounds 5] [--window 3]

Prints each attack's slowdown per round and its median; last lines:
RESULT isolation_victim_slowdown_p50=<median over attacks of each one's median>
RESULT isolation_victim_slowdown_max=<the largest attack's median>
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from harness.bad_adapters import truncate_weights, write_adapter
from harness.bench import print_result
from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import VictimResult, resident_adapter, solo_run, status_of, victim_beside
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.demo_adapters import write_peft_adapter

VICTIM_TOKENS = 384
Attack = Callable[[], None]


def attacks(server: InferenceServer, adapters: Path, channel: grpc.Channel) -> dict[str, Attack]:
    """The tests' attacks, each one call with its expected status (checked: a bench of the wrong
    behaviour measures nothing)."""
    stub = pb_grpc.InferenceStub(channel)
    raw = channel.unary_stream("/loraplex.v1.Inference/Generate", request_serializer=None,
                               response_deserializer=pb.GenerateResponse.FromString)

    def refused(request: pb.GenerateRequest, code: grpc.StatusCode) -> Attack:
        data = request.SerializeToString()  # built before the victim starts: the attacker's client work is not timed

        def attack() -> None:
            got = status_of(lambda: list(raw(data, timeout=60)))
            assert got == code, (got, code)
        return attack

    def generate(**fields: object) -> Attack:
        return lambda: list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))  # type: ignore[arg-type]

    loads = iter(range(10**9))

    def bad_load() -> None:
        name = f"truncated-{next(loads)}"
        got = status_of(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(
            name=name, uri=(adapters / "truncated").as_uri(), preload=True), timeout=60))
        assert got == grpc.StatusCode.INVALID_ARGUMENT, got

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    return {
        "tiny temperature": generate(text="attack", max_new_tokens=16, ignore_eos=True,
                                     sampling=pb.SamplingParams(temperature=1e-300)),
        "3 MiB prompt": refused(pb.GenerateRequest(text="p" * (3 << 20)), invalid),
        "900k stop ids": refused(pb.GenerateRequest(text="x", stop_token_ids=[7] * 900_000), invalid),
        "150k stop strings": refused(pb.GenerateRequest(text="x", stop=[f"s{i}" for i in range(150_000)]), invalid),
        "token id outside vocab": refused(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9])), invalid),
        "non-finite adapter": refused(pb.GenerateRequest(text="x", adapter="overflow", max_new_tokens=64,
                                                         ignore_eos=True), grpc.StatusCode.FAILED_PRECONDITION),
        "truncated adapter load": bad_load,
        "long stream on another adapter": generate(text="another tenant", adapter="other", max_new_tokens=600,
                                                    ignore_eos=True),
    }


def _runs_between(runs: list[dict], start: float, end: float) -> list[float]:
    return [r["seconds"] for r in runs if r["end"] > start and r["start"] < end]


def victim_alone(server: InferenceServer, base: VictimResult, window: float) -> float:
    """The median of the victim's runs that began after its first (which connects) within `window` s."""
    with victim_beside(server, base, check_clean=False) as runs:
        time.sleep(window)
    return statistics.median(r["seconds"] for r in runs[1:] or runs)


def victim_beside_attack(server: InferenceServer, base: VictimResult, attack: Attack, window: float) -> float:
    """The mean of the victim's runs that overlapped the attack, repeated for `window` s."""
    with victim_beside(server, base, check_clean=False) as runs:
        start = time.monotonic()
        while time.monotonic() - start < window:
            attack()
        end = time.monotonic()
    return statistics.mean(_runs_between(runs, start, end))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=float, default=3.0, help="seconds of each attack (and of each alone phase)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-isolation-") as tmp:
        adapters = Path(tmp) / "adapters"
        write_peft_adapter(adapters / "victim", seed=1)
        write_peft_adapter(adapters / "other", seed=3)
        write_peft_adapter(adapters / "overflow", seed=2, scale=1e18)  # finite in the file, inf in x·A·B
        truncate_weights(lambda n: n // 2)(write_adapter(adapters / "truncated"))
        server = start_inference_server(["--adapter-source-allow", adapters.as_uri(), "--max-loras", "4"],
                                        log_dir=tmp)
        try:
            resident_adapter(server, "victim", (adapters / "victim").as_uri())
            for name in ("other", "overflow"):
                resident_adapter(server, name, (adapters / name).as_uri())
            base = solo_run(server, adapter="victim", max_new_tokens=VICTIM_TOKENS)
            with server.channel(options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
                table = attacks(server, adapters, channel)
                slowdowns: dict[str, list[float]] = {name: [] for name in table}
                for round_ in range(args.rounds):
                    order = list(table) if round_ % 2 == 0 else list(reversed(table))
                    for name in order:
                        alone = victim_alone(server, base, args.window)
                        beside = victim_beside_attack(server, base, table[name], args.window)
                        slowdowns[name].append(beside / alone)
                    print(f"round {round_ + 1}: " + ", ".join(f"{n} {slowdowns[n][-1]:.2f}x" for n in table),
                          flush=True)
        finally:
            server.stop()
    medians = {name: statistics.median(values) for name, values in slowdowns.items()}
    for name, values in slowdowns.items():
        print(f"{name:32s} median {medians[name]:.2f}x  rounds " + " ".join(f"{v:.2f}" for v in values))
    print_result("isolation_victim_slowdown_p50", statistics.median(medians.values()))
    print_result("isolation_victim_slowdown_max", max(medians.values()))


if __name__ == "__main__":
    main()
