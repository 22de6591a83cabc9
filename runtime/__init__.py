"""The runtime: loads a compiled `glmc.plan.Plan` and serves it. Never imports the compiler.

    serving/  HTTP server, OpenAI protocol                      (imports engine, worker)
    engine/   requests, pages, prefix cache, scheduler, sampler, tokenizer, metrics, step loop
    worker/   one rank: loader, weights, KV pool, executors, collectives, launch
"""
