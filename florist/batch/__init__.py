"""Offline batch embedding: `florist embed INPUT -o OUTPUT` (docs/batch.md).

    plan.py      formats and the part plan: where each part of the input starts
    reader.py    reading one part as records (line numbers and an error for every bad one)
    embedder.py  Tokenize (CPU) and Embed (engine) a part, errors kept per record
    store.py     the output directory: atomic part files, manifest, the assembled result
    job.py       one job: resume checks, the run, the summary
    local.py     the job on this machine (reader, device and writer threads)
    ray_job.py   the job on Ray Data (read+tokenize tasks, one engine actor per GPU)
    progress.py  progress bar or log lines
"""
