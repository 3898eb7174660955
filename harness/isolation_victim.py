"""The victim client of harness/isolation.py, in a process of its own (a tenant is another client:
it must not share the attacker's interpreter and GIL).

`python -m harness.isolation_victim ADDRESS SPEC_JSON` runs greedy Generate calls back to back and
prints one JSON line per event: {"first": true} when a run's first message arrives, then
{"tokens": [...], "seconds": s, "start": t0, "end": t1, "messages": [t, ...], "finish": name} as it
ends (t0, t1 and each message's arrival: this machine's monotonic clock, which the harness's
time.monotonic() shares), or {"error": code, "details": text}. It makes `runs` runs, or with
`"loop": true` runs until its stdin is closed (the run in flight then finishes first), so it can keep
streaming for as long as an attack lasts.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc

from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient


def _closed_stdin() -> threading.Event:
    closed = threading.Event()

    def wait() -> None:
        sys.stdin.read()  # returns at EOF
        closed.set()

    threading.Thread(target=wait, daemon=True).start()
    return closed


def main() -> None:
    address, spec = sys.argv[1], json.loads(sys.argv[2])
    stop = _closed_stdin() if spec.get("loop") else None
    runs = 0
    # a tenant's bearer token, when the victim is a tenant
    metadata = (("authorization", f"Bearer {spec['token']}"),) if spec.get("token") else ()
    with InferenceClient(address) as client:
        while (stop is None and runs < spec["runs"]) or (stop is not None and not stop.is_set()):
            runs += 1
            tokens: list[int] = []
            arrivals: list[float] = []
            finish = pb.FINISH_REASON_UNSPECIFIED
            t0 = time.monotonic()
            try:
                request = client.request(spec["prompt"], adapter=spec["adapter"], ignore_eos=True,
                                         max_new_tokens=spec["max_new_tokens"])
                for msg in client.stub.Generate(request, metadata=metadata, timeout=120):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 1:
                        print(json.dumps({"first": True}), flush=True)
                    tokens.extend(msg.token_ids)
                    finish = msg.finish_reason or finish
            except grpc.RpcError as e:
                print(json.dumps({"error": e.code().name, "details": e.details()}), flush=True)
                return
            t1 = time.monotonic()
            print(json.dumps({"tokens": tokens, "seconds": t1 - t0, "start": t0, "end": t1,
                              "messages": [round(t, 4) for t in arrivals],
                              "finish": pb.FinishReason.Name(finish)}), flush=True)


if __name__ == "__main__":
    main()
