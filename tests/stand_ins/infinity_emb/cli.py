"""A stand-in for infinity-emb's command line, for tests of bench/serve.py's Infinity path where
infinity-emb is not installed (it needs transformers < 5): the `v2` arguments the bench passes,
Infinity's start-up line, /health at the root, POST {--url-prefix}/embeddings taking text only
(token ids are refused with 422, as Infinity's request model refuses them) for an embedding
model, and POST {--url-prefix}/rerank (Cohere's shape) for a sequence classifier, answered by
bench/baseline_server.py's sentence-transformers handlers. With STAND_IN_EXIT_AFTER=N in its
environment the process dies on its (N + 1)-th embedding request, as a server that crashes does;
with STAND_IN_FAIL_START=1 it exits (code 1) before its start-up line, as one missing a package does;
with STAND_IN_HEALTH_500=1 it starts but answers /health with 500, as Infinity without orjson does.

    python -m infinity_emb.cli v2 --model-id DIR --engine torch --device cpu --dtype float32 \
        --host 127.0.0.1 --port PORT --url-prefix /v1
"""

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import baseline_server  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> int:
    p = argparse.ArgumentParser(prog="infinity_emb")
    v2 = p.add_subparsers(dest="command", required=True).add_parser("v2")
    v2.add_argument("--model-id", required=True)
    v2.add_argument("--engine", choices=["torch"], required=True)
    v2.add_argument("--device", choices=["cpu", "cuda"], required=True)
    v2.add_argument("--device-id", default="")
    v2.add_argument("--dtype", choices=sorted(DTYPES), required=True)
    v2.add_argument("--host", required=True)
    v2.add_argument("--port", type=int, required=True)
    v2.add_argument("--url-prefix", default="")
    args = p.parse_args()

    if os.environ.get("STAND_IN_FAIL_START") == "1":
        print("stand-in: failing to start", flush=True)
        return 1
    from aiohttp import web

    device = f"{args.device}:{args.device_id}" if args.device_id else args.device
    architectures = json.loads((Path(args.model_id) / "config.json").read_text()).get("architectures") or [""]
    task = "score" if architectures[0].endswith("ForSequenceClassification") else "embed"  # as Infinity tells a reranker
    model = baseline_server.load_model(args.model_id, task, device, DTYPES[args.dtype])
    handlers = baseline_server.Handlers(model, task, Path(args.model_id).name)

    served = [0]

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        if not all(isinstance(t, str) for t in texts):
            return web.json_response({"detail": "input: text only"}, status=422)
        served[0] += 1
        if served[0] > int(os.environ.get("STAND_IN_EXIT_AFTER", 1 << 62)):
            print(f"stand-in: exiting on request {served[0]}", flush=True)
            os._exit(3)
        result = await asyncio.get_running_loop().run_in_executor(None, handlers.embeddings, texts, body.get("encoding_format", "float"))
        return web.json_response(result)

    async def rerank(request: web.Request) -> web.Response:
        body = await request.json()
        served[0] += 1
        scored = await asyncio.get_running_loop().run_in_executor(None, handlers.score, body["query"], body["documents"])
        return web.json_response({"object": "rerank", "results": [{"relevance_score": d["score"], "index": d["index"]} for d in scored["data"]]})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post(f"{args.url_prefix}/{'rerank' if task == 'score' else 'embeddings'}", rerank if task == "score" else embeddings)
    async def health(request: web.Request) -> web.Response:
        if os.environ.get("STAND_IN_HEALTH_500") == "1":
            print("stand-in: AssertionError: orjson must be installed to use ORJSONResponse", flush=True)
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response({"unix": 0.0})

    app.router.add_get("/health", health)
    if os.environ.get("STAND_IN_HEALTH_500") == "1":
        print("stand-in: /health will answer 500", flush=True)  # before the start-up line, so the run has it when it gives up
    print(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
