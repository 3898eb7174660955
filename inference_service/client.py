"""A small synchronous client for loraplex.v1.Inference."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc


class InferenceClient:
    """`InferenceClient("127.0.0.1:50051")`; `token` is the admin bearer token for LoadAdapter /
    UnloadAdapter; `root_certificates` (PEM bytes) switches to TLS, plus `client_cert` /
    `client_key` for mTLS."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        root_certificates: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
        server_name: str | None = None,
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, client_key, client_cert)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self._admin_md = (("authorization", f"Bearer {token}"),) if token else ()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | Sequence[int],
        adapter: str | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str = "",
        n: int | None = None,
        priority: int = 0,
    ) -> pb.GenerateRequest:
        """`n`: samples of the prompt (responses carry each one's `index`); unset means 1.
        `priority`: lower is admitted first (within what the caller's tenant may ask for)."""
        req = pb.GenerateRequest(
            request_id=request_id,
            adapter=adapter or "",
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            ignore_eos=ignore_eos,
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        req.sampling.temperature = temperature
        req.sampling.top_k = top_k
        if top_p is not None:
            req.sampling.top_p = top_p
        if seed is not None:
            req.sampling.seed = seed
        if max_new_tokens is not None:
            req.max_new_tokens = max_new_tokens
        if n is not None:
            req.n = n
        req.priority = priority
        return req

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **kwargs: object) -> Iterator[pb.GenerateResponse]:
        """Streams GenerateResponse deltas; the last carries finish_reason, usage and timings.
        Stopping the iteration early (or `.cancel()` on it) cancels the request."""
        return self.stub.Generate(self.request(prompt, **kwargs), timeout=timeout)  # type: ignore[arg-type]

    def generate_text(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                      **kwargs: object) -> str:
        return "".join(d.text for d in self.generate(prompt, timeout=timeout, **kwargs))

    def load_adapter(self, name: str, uri: str, sha256: str = "", pinned: bool = False,
                     preload: bool = False, timeout: float | None = None, shared: bool = False,
                     tenant: str = "") -> pb.Adapter:
        """`shared`, `tenant`: an admin's load of a shared adapter or into a tenant's namespace."""
        req = pb.LoadAdapterRequest(name=name, uri=uri, sha256=sha256, pinned=pinned, preload=preload,
                                    shared=shared, tenant=tenant)
        return self.stub.LoadAdapter(req, metadata=self._admin_md, timeout=timeout).adapter

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=self._admin_md, timeout=timeout)

    def list_adapters(self, timeout: float | None = None) -> list[pb.Adapter]:
        """Every registered adapter (all pages); URIs only with an admin token."""
        adapters: list[pb.Adapter] = []
        token = ""
        while True:
            page = self.stub.ListAdapters(pb.ListAdaptersRequest(page_token=token), metadata=self._admin_md,
                                          timeout=timeout)
            adapters.extend(page.adapters)
            token = page.next_page_token
            if not token:
                return adapters

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
