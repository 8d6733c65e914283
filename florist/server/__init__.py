"""The inference server: a gRPC service in front of one engine (see DESIGN.md, part 2).

    florist.proto   the contract (message classes built at import time by proto.py)
    scheduler.py    pending sequences, first come first served under a token budget (no torch)
    batcher.py      the loop that forms batches, launches them and hands results back
    service.py      the grpc.aio servicer: validation, per-request finishing, server start-up
    client.py       an async client for tests, benchmarks and the gateway
    config.py       ServerConfig (settings fixed at start-up)
    wire.py         bytes <-> numpy for token batches and matrices, with the input checks
    metrics.py      Prometheus metrics (own registry per server)
    cli.py          `florist engine-server`

Nothing is imported here, so importing the scheduler does not import torch.
"""
