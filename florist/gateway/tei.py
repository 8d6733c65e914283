"""text-embeddings-inference routes: `/embed`, `/rerank`, `/tokenize`, `/decode`, `/info`,
`/health`, and `POST /` (what huggingface_hub's InferenceClient(base_url=...) calls: /embed for
an embedding model, /rerank for a scorer).

    POST /embed    {"inputs": "text" | [...], "normalize": true, "truncate": false,
                    "truncation_direction": "right", "prompt_name": null, "dimensions": null}
                   -> [[float, ...], ...]
    POST /rerank   {"query": "...", "texts": [...], "raw_scores": false, "return_text": false, "truncate": false}
                   -> [{"index": 1, "score": 0.93, "text"?: "..."}, ...] best first
    POST /tokenize {"inputs": "text" | [...], "add_special_tokens": true, "prompt_name": null}
                   -> [[{"id", "text", "special", "start", "stop"}, ...], ...]

Differences from TEI: bad input is always 400 (TEI answers 413 / 422), and `normalize` defaults
to true as in TEI (the OpenAI route follows the model's own Normalize module instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

import florist
from florist.gateway import jsonio
from florist.gateway.errors import ApiError
from florist.gateway.inputs import SHAPES, parse_inputs
from florist.gateway.pipeline import pipeline_of
from florist.gateway.schema import parse

Direction = Literal["right", "left", "Right", "Left"]


@dataclass(frozen=True)
class EmbedRequest:
    inputs: Any = field(metadata={"expects": SHAPES})
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    dimensions: int | None = None
    input_format: Literal["json", "base64"] = "json"


@dataclass(frozen=True)
class RerankRequest:
    query: str
    texts: list[str]
    truncate: bool = False
    truncation_direction: Direction = "right"
    raw_scores: bool = False
    return_text: bool = False


@dataclass(frozen=True)
class TokenizeRequest:
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


@dataclass(frozen=True)
class DecodeRequest:
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


async def embed(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(EmbedRequest, await jsonio.read_json(request))
    pipe.require("embed", "/embed")
    inputs = parse_inputs(req.inputs, field="inputs", input_format=req.input_format, max_inputs=pipe.config.max_inputs)
    out = await pipe.embed(inputs, prompt=pipe.prompt(prompt_name=req.prompt_name), truncate=req.truncate,
                           direction=req.truncation_direction.lower(), dimensions=req.dimensions, normalize=req.normalize)
    return jsonio.response(out.matrix)


def check_documents(docs: list[str], field: str, max_inputs: int) -> None:
    if not docs:
        raise ApiError(400, f"{field} is empty; send at least one document to rank", param=field)
    if len(docs) > max_inputs:
        raise ApiError(400, f"{field} has {len(docs)} documents; this server takes at most {max_inputs} per request; send them in several requests", param=field, code="too_many_inputs")


def check_right_truncation(direction: str) -> None:
    if direction.lower() != "right":
        raise ApiError(400, "(query, document) pairs are truncated at the end of the document only; use truncation_direction \"right\"", param="truncation_direction")


async def rerank(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(RerankRequest, await jsonio.read_json(request))
    pipe.require("score", "/rerank")
    check_documents(req.texts, "texts", pipe.config.max_inputs)
    check_right_truncation(req.truncation_direction)
    scores, _ = await pipe.score([req.query] * len(req.texts), req.texts, truncate=req.truncate, raw=req.raw_scores)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep input order
    out = [{"index": i, "score": float(scores[i]), **({"text": req.texts[i]} if req.return_text else {})} for i in order]
    return jsonio.response(out)


async def root(request: web.Request) -> web.Response:
    return await (embed if pipeline_of(request).info.task == "embed" else rerank)(request)


async def tokenize(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(TokenizeRequest, await jsonio.read_json(request))
    texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    if not texts:
        raise ApiError(400, "inputs is empty; send at least one text", param="inputs")
    if len(texts) > pipe.config.max_inputs:
        raise ApiError(400, f"inputs has {len(texts)} texts; this server takes at most {pipe.config.max_inputs} per request", param="inputs", code="too_many_inputs")
    prompt = pipe.prompt(prompt_name=req.prompt_name)
    tokens = await pipe.tokenization.detailed([prompt + t for t in texts], add_special_tokens=req.add_special_tokens)
    return jsonio.response([[{"id": i, "text": t, "special": s, "start": a, "stop": b} for i, t, s, a, b in seq] for seq in tokens])


async def decode(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(DecodeRequest, await jsonio.read_json(request))
    batch = req.ids if req.ids and isinstance(req.ids[0], list) else [req.ids]
    vocab = pipe.info.vocab_size
    for i, ids in enumerate(batch):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"ids[{i}] has token id {bad[0]}, outside the vocabulary [0, {vocab})", param="ids")
    texts = [pipe.tokenization.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in batch]
    return jsonio.response(texts)


async def info(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    i, c = pipe.info, pipe.config
    model_type = {"embed": {"embedding": {"pooling": "+".join(i.pooling) or "mean"}}, "score": {"reranker": {"id2label": {"0": "score"}}}}.get(i.task, {i.task: {}})
    return jsonio.response({
        "model_id": i.model_name, "model_sha": None, "tokenizer_sha256": i.tokenizer_sha256, "model_dtype": i.dtype, "model_type": model_type,
        "max_input_length": i.max_input_tokens, "max_batch_tokens": pipe.dispatcher.limits.max_tokens,
        "max_client_batch_size": c.max_inputs, "payload_limit": c.payload_limit_bytes,
        "tokenization_workers": c.tokenization_workers, "auto_truncate": False, "version": florist.__version__,
        "dimensions": i.dimensions, "prompts": {p.name: p.text for p in i.prompts}, "default_prompt_name": i.default_prompt_name or None,
        "replicas": {"total": len(pipe.balancer.replicas), "healthy": pipe.balancer.healthy_count},
    })


async def health(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    if not pipe.balancer.healthy_count:
        raise ApiError(503, "no engine replica is healthy", retry_after_s=pipe.config.retry_after_s)
    return jsonio.response({"status": "ok", "healthy_replicas": pipe.balancer.healthy_count})


ROUTES = [
    ("POST", "/", root, "tei"),
    ("POST", "/embed", embed, "tei"),
    ("POST", "/rerank", rerank, "tei"),
    ("POST", "/tokenize", tokenize, "tei"),
    ("POST", "/decode", decode, "tei"),
    ("GET", "/info", info, "tei"),
    ("GET", "/health", health, "tei"),
]
