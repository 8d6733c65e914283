"""The baseline for bench/serve.py: the minimal embedding / scoring server a user would otherwise
stand up, on sentence-transformers and transformers, behind FastAPI + uvicorn.

    POST /v1/embeddings {"input": "text" | ["text", ...] | [[id, ...], ...], "encoding_format": "float" | "base64"}
    POST /v1/score      {"text_1": "query", "text_2": ["document", ...]}
    GET  /health

The routes answer in the same shapes as florist's gateway (OpenAI; vLLM's /v1/score), so one
client measures both. The models are run the way their model cards say:

    embedding model          SentenceTransformer(path).encode(texts); pre-tokenized inputs go
                             through the same modules (st.forward on padded ids), 32 at a time
    pplx-embed (bidirectional_pplx_qwen3)
                             its remote code is not importable offline: transformers' Qwen3Model
                             with every layer's attention made non-causal, mean pooled
    cross-encoder            CrossEncoder(path).predict(pairs)
    Qwen3 reranker           the model card's code: chat template, left padding, sigmoid(yes - no)
                             at the last token (with logits_to_keep=1, kinder to the baseline than
                             the card, which computes every position's logits)

The handlers are plain functions: FastAPI runs them on its thread pool, as a `def` endpoint
does. Without fastapi / uvicorn / pydantic the same handlers run behind aiohttp (a thread pool
too), and the start-up line says which server ran.

    python bench/baseline_server.py --model DIR --task embed --device cuda --dtype bf16 --port 0
    -> prints "baseline server: fastapi+uvicorn, sentence-transformers ... on http://127.0.0.1:PORT"
"""

# NOTE: no `from __future__ import annotations`: FastAPI and pydantic read the request models'
# annotations at run time.
import argparse
import base64
import importlib.util
import json
import socket
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MINI_BATCH = 32  # sentence-transformers' default batch_size


class BadRequest(ValueError):
    pass


# -- models ----------------------------------------------------------------------------------------
class STEmbedder:
    name = "sentence-transformers SentenceTransformer"

    def __init__(self, path: str, device: str, dtype: torch.dtype):
        from sentence_transformers import SentenceTransformer

        self.st = SentenceTransformer(path, device=device, model_kwargs={"dtype": dtype})
        self.pad_id = self.st.tokenizer.pad_token_id or 0

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        return self.st.encode(texts, batch_size=MINI_BATCH, convert_to_numpy=True).astype(np.float32)

    @torch.inference_mode()
    def embed_ids(self, seqs: list[list[int]]) -> np.ndarray:
        out = []
        for k in range(0, len(seqs), MINI_BATCH):
            ids, mask = pad(seqs[k : k + MINI_BATCH], self.pad_id, self.st.device)
            out.append(self.st.forward({"input_ids": ids, "attention_mask": mask})["sentence_embedding"].float().cpu().numpy())
        return np.concatenate(out)


class BidirectionalQwen3Embedder:
    """pplx-embed: Qwen3 without the causal mask, mean pooled (what its remote code computes)."""

    name = "transformers Qwen3Model, non-causal, mean pooled"

    def __init__(self, path: str, device: str, dtype: torch.dtype):
        from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

        config = Qwen3Config.from_dict({k: v for k, v in json.loads((Path(path) / "config.json").read_text()).items() if k not in ("model_type", "architectures", "auto_map")})
        self.model = Qwen3Model.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        for layer in self.model.layers:
            layer.self_attn.is_causal = False
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = device

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        return self.embed_ids(self.tokenizer(texts)["input_ids"])

    @torch.inference_mode()
    def embed_ids(self, seqs: list[list[int]]) -> np.ndarray:
        # NOTE: transformers builds a causal mask whenever it is given one; without a mask the
        # non-causal flag holds. So sequences run in groups of equal length, without padding.
        out: list[np.ndarray | None] = [None] * len(seqs)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_len.setdefault(len(s), []).append(i)
        for idx in by_len.values():
            for k in range(0, len(idx), MINI_BATCH):
                part = idx[k : k + MINI_BATCH]
                ids = torch.tensor([seqs[i] for i in part], dtype=torch.long, device=self.device)
                rows = self.model(input_ids=ids).last_hidden_state.float().mean(1).cpu().numpy()
                for i, row in zip(part, rows):
                    out[i] = row
        return np.stack(out)


class CrossEncoderScorer:
    name = "sentence-transformers CrossEncoder"

    def __init__(self, path: str, device: str, dtype: torch.dtype):
        from sentence_transformers import CrossEncoder

        self.ce = CrossEncoder(path, device=device, model_kwargs={"dtype": dtype})

    def score(self, query: str, docs: list[str]) -> np.ndarray:
        return np.asarray(self.ce.predict([(query, d) for d in docs], batch_size=MINI_BATCH), dtype=np.float32).reshape(-1)


class Qwen3RerankerScorer:
    """The Qwen3-Reranker model card's code."""

    name = "transformers Qwen3ForCausalLM, Qwen3-Reranker model card"
    PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. '
              'Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

    def __init__(self, path: str, device: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        self.yes, self.no = self.tokenizer.convert_tokens_to_ids("yes"), self.tokenizer.convert_tokens_to_ids("no")
        self.prefix = self.tokenizer.encode(self.PREFIX, add_special_tokens=False)
        self.suffix = self.tokenizer.encode(self.SUFFIX, add_special_tokens=False)
        self.max_length = min(self.tokenizer.model_max_length, self.model.config.max_position_embeddings)
        self.device = device

    @torch.inference_mode()
    def score(self, query: str, docs: list[str]) -> np.ndarray:
        bodies = [f"<Instruct>: {self.INSTRUCTION}\n<Query>: {query}\n<Document>: {d}" for d in docs]
        budget = self.max_length - len(self.prefix) - len(self.suffix)
        out = []
        for k in range(0, len(bodies), MINI_BATCH):
            enc = self.tokenizer(bodies[k : k + MINI_BATCH], padding=False, truncation="longest_first", max_length=budget,
                                 add_special_tokens=False, return_attention_mask=False)
            seqs = [self.prefix + ids + self.suffix for ids in enc["input_ids"]]
            batch = self.tokenizer.pad({"input_ids": seqs}, padding=True, return_tensors="pt").to(self.device)
            logits = self.model(**batch, logits_to_keep=1).logits[:, -1, :].float()
            out.append(torch.sigmoid(logits[:, self.yes] - logits[:, self.no]).cpu().numpy())
        return np.concatenate(out)


def pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, as a tokenizer's padding=True gives them."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def load_model(path: str, task: str, device: str, dtype: torch.dtype):
    config = json.loads((Path(path) / "config.json").read_text())
    if task == "embed":
        cls = BidirectionalQwen3Embedder if config.get("model_type") == "bidirectional_pplx_qwen3" else STEmbedder
    elif task == "score":
        archs = config.get("architectures") or [""]
        cls = Qwen3RerankerScorer if archs[0].endswith("ForCausalLM") else CrossEncoderScorer
    else:
        raise SystemExit(f"baseline server: unknown task {task!r}; choose embed or score")
    return cls(path, device, dtype)


# -- the handlers, shared by both HTTP servers -------------------------------------------------------
class Handlers:
    def __init__(self, model, task: str, model_name: str):
        self.model, self.task, self.model_name = model, task, model_name

    def embeddings(self, inputs, encoding_format: str = "float") -> dict:
        if self.task != "embed":
            raise BadRequest("this server serves a scoring model; use /v1/score")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise BadRequest("input must be a string, a list of strings or a list of token-id lists")
        if all(isinstance(x, str) for x in inputs):
            matrix = self.model.embed_texts(inputs)
        elif all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in inputs):
            matrix = self.model.embed_ids(inputs)
        else:
            raise BadRequest("input must be a string, a list of strings or a list of token-id lists")
        if encoding_format == "base64":
            rows = [base64.b64encode(r.astype("<f4").tobytes()).decode("ascii") for r in matrix]
        else:
            rows = matrix.tolist()
        return {"object": "list", "model": self.model_name, "data": [{"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(rows)],
                "usage": {"prompt_tokens": 0, "total_tokens": 0}}

    def score(self, text_1, text_2) -> dict:
        if self.task != "score":
            raise BadRequest("this server serves an embedding model; use /v1/embeddings")
        if not isinstance(text_1, str) or not isinstance(text_2, list) or not text_2 or not all(isinstance(d, str) for d in text_2):
            raise BadRequest("send text_1 as one query string and text_2 as a list of document strings")
        scores = self.model.score(text_1, text_2)
        return {"object": "list", "model": self.model_name, "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]}


# -- FastAPI + uvicorn, or aiohttp -------------------------------------------------------------------
def fastapi_app(handlers: Handlers):
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    class EmbeddingRequest(BaseModel):
        input: str | list[str] | list[list[int]]
        model: str | None = None
        encoding_format: Literal["float", "base64"] = "float"

    class ScoreRequest(BaseModel):
        text_1: str
        text_2: list[str]
        model: str | None = None

    app = FastAPI()

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingRequest):  # a plain def: FastAPI runs it on its thread pool
        try:
            return handlers.embeddings(req.input, req.encoding_format)
        except BadRequest as e:
            raise HTTPException(400, str(e))

    @app.post("/v1/score")
    def score(req: ScoreRequest):
        try:
            return handlers.score(req.text_1, req.text_2)
        except BadRequest as e:
            raise HTTPException(400, str(e))

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return app


def run_aiohttp(handlers: Handlers, sock: socket.socket) -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from aiohttp import web

    pool = ThreadPoolExecutor(40)  # the size of the thread pool FastAPI runs `def` endpoints on

    def route(call):
        async def handle(request: web.Request) -> web.Response:
            try:
                body = await request.json()
                result = await asyncio.get_running_loop().run_in_executor(pool, call, body)
            except (BadRequest, KeyError, TypeError, ValueError) as e:
                return web.json_response({"detail": str(e)}, status=400)
            return web.json_response(result)
        return handle

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/embeddings", route(lambda body: handlers.embeddings(body["input"], body.get("encoding_format", "float"))))
    app.router.add_post("/v1/score", route(lambda body: handlers.score(body["text_1"], body["text_2"])))
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    web.run_app(app, sock=sock, print=None, access_log=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--task", required=True, choices=["embed", "score"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--http", default="auto", choices=["auto", "fastapi", "aiohttp"], help="auto: FastAPI + uvicorn when importable")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    model = load_model(args.model, args.task, args.device, dtype)
    handlers = Handlers(model, args.task, Path(args.model).name)
    http = args.http
    if http == "auto":
        http = "fastapi" if all(importlib.util.find_spec(m) for m in ("fastapi", "pydantic", "uvicorn")) else "aiohttp"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    if http == "aiohttp":
        sock.listen(1024)  # aiohttp serves a listening socket; uvicorn calls listen() itself
    # NOTE: bench/serve.py reads the URL from this line; keep "on http://HOST:PORT".
    server_name = "fastapi+uvicorn" if http == "fastapi" else "aiohttp (fastapi not importable)" if args.http == "auto" else "aiohttp"
    print(f"baseline server: {server_name}, {model.name}, {args.device} {str(dtype).removeprefix('torch.')}, "
          f"on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    if http == "fastapi":
        import uvicorn

        uvicorn.Server(uvicorn.Config(fastapi_app(handlers), log_level="warning", access_log=False)).run(sockets=[sock])
    else:
        run_aiohttp(handlers, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
