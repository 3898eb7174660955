"""`loraplex`: command-line client for a loraplex inference server."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc

from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description="Client for the loraplex gRPC inference server.")
    p.add_argument("--address", default=os.environ.get("LORAPLEX_ADDRESS", "127.0.0.1:50051"),
                   help="server address, HOST:PORT or unix:///path [env LORAPLEX_ADDRESS]")
    p.add_argument("--token", default=os.environ.get("LORAPLEX_TOKEN"),
                   help="admin bearer token for load/unload [env LORAPLEX_TOKEN]")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to verify the server; enables TLS")
    p.add_argument("--tls-cert", help="client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", help="client key (PEM) for mTLS")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt")
    g.add_argument("--adapter", default="", help="adapter name (default: the base model)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")

    ld = sub.add_parser("load", help="register (or version-swap) an adapter")
    ld.add_argument("name")
    ld.add_argument("uri")
    ld.add_argument("--sha256", default="")
    ld.add_argument("--pinned", action="store_true")
    ld.add_argument("--preload", action="store_true", help="load into a slot now")

    ul = sub.add_parser("unload", help="remove an adapter (in-flight requests finish first)")
    ul.add_argument("name")

    sub.add_parser("list", help="list adapters")
    sub.add_parser("info", help="describe the model and limits")
    return p


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = InferenceClient(args.address, token=args.token, root_certificates=_read(args.tls_ca),
                             client_cert=_read(args.tls_cert), client_key=_read(args.tls_key))
    try:
        return _run(client, args)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _run(client: InferenceClient, args: argparse.Namespace) -> int:
    if args.command == "generate":
        stream = client.generate(
            args.prompt, timeout=args.timeout, adapter=args.adapter, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            stop=args.stop, ignore_eos=args.ignore_eos,
        )
        parts: list[str] = []
        last = None
        for delta in stream:
            last = delta
            if args.stream:
                print(delta.text, end="", flush=True)
            else:
                parts.append(delta.text)
        if not args.stream:
            print("".join(parts), end="")
        print()
        if last is not None and last.finish_reason:
            reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
            print(f"[finish={reason} prompt_tokens={last.usage.prompt_tokens} "
                  f"generated_tokens={last.usage.generated_tokens} "
                  f"ttft={last.timings.time_to_first_token_seconds:.3f}s]", file=sys.stderr)
    elif args.command == "load":
        a = client.load_adapter(args.name, args.uri, sha256=args.sha256, pinned=args.pinned,
                                preload=args.preload, timeout=args.timeout)
        print(_adapter_line(a))
    elif args.command == "unload":
        client.unload_adapter(args.name, timeout=args.timeout)
        print(f"unloaded {args.name}")
    elif args.command == "list":
        print(f"{'NAME':24} {'STATE':11} {'SLOT':>4} {'RANK':>4} {'PIN':3} {'ACTIVE':>6}  URI")
        for a in client.list_adapters(timeout=args.timeout):
            print(_adapter_line(a))
    elif args.command == "info":
        m = client.model_info(timeout=args.timeout)
        print(f"model={m.model_name} max_context={m.max_context} vocab={m.vocab_size} "
              f"max_loras={m.max_loras} max_lora_rank={m.max_lora_rank} "
              f"max_new_tokens_limit={m.max_new_tokens_limit}")
    return 0


def _adapter_line(a: pb.Adapter) -> str:
    state = pb.AdapterState.Name(a.state).removeprefix("ADAPTER_STATE_")
    return (f"{a.name:24} {state:11} {a.slot:>4} {a.rank:>4} {'yes' if a.pinned else 'no':3} "
            f"{a.active_requests:>6}  {a.uri}")


if __name__ == "__main__":
    sys.exit(main())
