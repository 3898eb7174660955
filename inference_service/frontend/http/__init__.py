"""The OpenAI-compatible HTTP front end: the same Engine as the gRPC servicer, on its own port
in the same process and asyncio loop (see docs/http.md)."""
