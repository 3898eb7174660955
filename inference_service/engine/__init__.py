"""The engine: its core (scheduler, model runner, KV cache, sampling, outputs), the two ways to run
it (in process, in a process of its own) and the one interface front ends hold it by (`client`)."""
