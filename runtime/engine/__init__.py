"""The engine: requests, pages, prefix cache, scheduler, sampler, tokenizer and metrics, and the
step loop that drives a worker's `ModelRunner` (one rank, or all ranks from rank 0)."""
