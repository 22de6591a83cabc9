"""Execution on one rank: a loaded plan's weights, KV pool, executor (torch or CUDA target),
collectives and process launch. Knows nothing of requests or HTTP."""
