"""The front ends: gRPC (`grpc_server`) and OpenAI HTTP (`http/`), with what they share (intake,
auth, health, preload, adapter resolution, Prometheus metrics). They reach the engine only through
`engine.client` and the types it names."""
