"""Greedy generation on the embedding engine's layers (docs/generation.md walks a request through).

    config.py        GenerationConfig (settings fixed at start-up; no torch)
    scheduler.py     sequences, KV-cache slots, prefill/decode steps (plain Python, no torch)
    batch.py         GenerationBatch: the per-step metadata, packed into one int32 buffer per step
    kv_cache.py      the slot-based KV cache and its binding to the attention layers
    decode_graphs.py decode steps replayed from CUDA graphs, one per batch-size bucket
    prefill_graphs.py prefill steps replayed from CUDA graphs, bucketed like the embedding ones
    runner.py        one rank's model, cache and graphs: prefill / decode / decode_next (pipelined)
    tp.py            tensor parallel workers and the step broadcast from rank 0
    generator.py     scheduler + runner: submit / step / generate; pipelined decode (host and
                     device in flight together); warm_up before serving
    detokenizer.py   incremental detokenization for streaming (no torch)
    cli.py           `florist generate`

Pinned host buffers reused every step (inputs in, next ids out) live in florist/engine/staging.py,
shared with the embedding engine's CUDA graphs.

Nothing is imported here, so the scheduler and the detokenizer stay free of torch.
"""
