"""The front ends, side by side: gRPC (`grpc_server`, `grpc_proto`) and OpenAI HTTP (`http/`), neither
importing the other. What they share sits beside them: the settings (`config`), the one admission
path of a generation request (`admission`, over `intake`, `tenants`, `tenant_adapters`,
`grammar_check`, `adapter_resolver`, `cache_salt`), auth, health, preload and Prometheus metrics.
`server` runs the process that starts, readies and drains both. They reach the engine only through
`engine.client` and the types it names."""
