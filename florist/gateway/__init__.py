"""The HTTP gateway (see DESIGN.md, part 1, and docs/gateway.md).

A request's path:

    HTTP ─▶ app.py (key, size) ─▶ openai.py / completions.py / tei.py / rerank.py (the API's shape, schema.py, inputs.py)
        ─▶ pipeline.py ─▶ tokenization.py (TextProcessor on a thread pool; on the loop when small)
                       ─▶ dispatch.py (chunks, in order) ─▶ balancer.py (replica per chunk, health) ─▶ gRPC
        ◀─ rows checked (one per input, finite) ◀─ JSON (jsonio.py) ◀─ errors in the API's shape (errors.py)

    completions.py  POST /v1/completions on a causal LM: one streamed Generate call per prompt (dispatch.py),
                    text deltas and stop strings in completion_text.py, server-sent events
    config.py       GatewayConfig (settings fixed at start-up)
    server.py       start_gateway / GatewayThread / run_loop (uvloop when installed)
    metrics.py      Prometheus metrics and GET /metrics (multiprocess-aware)
    cli.py          `florist serve` flags; supervisor.py and processes.py run the engines and workers

Nothing is imported here, so `florist --help` stays light.
"""
