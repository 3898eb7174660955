"""The victim client of harness/isolation.py, in a process of its own (a tenant is another client:
it must not share the attacker's interpreter and GIL).

`python -m harness.isolation_victim ADDRESS SPEC_JSON` runs `runs` greedy Generate calls in a row and
prints one JSON line per event: {"first": true} when the first run's first message arrives, then
{"tokens": [...], "seconds": s, "finish": name} per run, or {"error": code, "details": text}.
"""

from __future__ import annotations

import json
import sys
import time

import grpc

from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient


def main() -> None:
    address, spec = sys.argv[1], json.loads(sys.argv[2])
    first = True
    with InferenceClient(address) as client:
        for _ in range(spec["runs"]):
            tokens: list[int] = []
            finish = pb.FINISH_REASON_UNSPECIFIED
            t0 = time.monotonic()
            try:
                for msg in client.generate(spec["prompt"], adapter=spec["adapter"], ignore_eos=True,
                                           max_new_tokens=spec["max_new_tokens"], timeout=120):
                    if first:
                        print(json.dumps({"first": True}), flush=True)
                        first = False
                    tokens.extend(msg.token_ids)
                    finish = msg.finish_reason or finish
            except grpc.RpcError as e:
                print(json.dumps({"error": e.code().name, "details": e.details()}), flush=True)
                return
            seconds = time.monotonic() - t0
            print(json.dumps({"tokens": tokens, "seconds": seconds, "finish": pb.FinishReason.Name(finish)}),
                  flush=True)


if __name__ == "__main__":
    main()
