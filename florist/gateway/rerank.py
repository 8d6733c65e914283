"""Ranking routes in the shapes of Cohere / Jina (`POST /v1/rerank`) and vLLM (`POST /v1/score`).

    POST /v1/rerank {"query": "...", "documents": ["..." | {"text": "..."}], "top_n": 3, "return_documents": false}
      -> {"id": ..., "model": ..., "results": [{"index": 2, "relevance_score": 0.97, "document"?: {"text": ...}}],
          "usage": {"total_tokens": n}}                                           best first, top_n of them
    POST /v1/score  {"text_1": "q" | ["q1", ...], "text_2": "d" | ["d1", ...]}
      -> {"id", "object": "list", "model", "data": [{"index": i, "object": "score", "score": s}], "usage"}
         one text_1 against every text_2, or text_1[i] against text_2[i] (lists of equal length)

Both take `truncate` (cut over-long pairs at the document's end), `raw_scores` (logits without
the model's activation) and `instruction` (the Qwen3 reranker's task instruction).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from florist.gateway import jsonio
from florist.gateway.errors import ApiError
from florist.gateway.pipeline import pipeline_of
from florist.gateway.schema import json_type, parse
from florist.gateway.tei import check_documents

_DOCUMENTS = 'a list of strings or of {"text": "..."} objects'


@dataclass(frozen=True)
class RerankRequest:
    query: str
    documents: Any = field(metadata={"expects": _DOCUMENTS})
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False
    truncate: bool = False
    raw_scores: bool = False
    instruction: str | None = None
    max_chunks_per_doc: int | None = None  # Cohere v1 clients send it; one chunk is all florist takes


@dataclass(frozen=True)
class ScoreRequest:
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate: bool = False
    raw_scores: bool = False
    instruction: str | None = None


def _document_texts(documents: Any) -> list[str]:
    if not isinstance(documents, list):
        raise ApiError(400, f"documents must be {_DOCUMENTS}; got {json_type(documents)}", param="documents")
    texts = []
    for i, d in enumerate(documents):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise ApiError(400, f"documents[{i}] is {json_type(d)}; documents must be {_DOCUMENTS}", param="documents")
        texts.append(d)
    return texts


async def rerank(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(RerankRequest, await jsonio.read_json(request))
    pipe.require("score", "/v1/rerank")
    pipe.check_model(req.model)
    docs = _document_texts(req.documents)
    check_documents(docs, "documents", pipe.config.max_inputs)
    if req.top_n is not None and req.top_n < 1:
        raise ApiError(400, f"top_n must be at least 1; got {req.top_n} (leave it out to get every document)", param="top_n")
    scores, num_tokens = await pipe.score([req.query] * len(docs), docs, truncate=req.truncate, raw=req.raw_scores, instruction=req.instruction)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n]
    results = [{"index": i, "relevance_score": float(scores[i]), **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
    return jsonio.response({"id": str(uuid.uuid4()), "model": pipe.info.model_name, "results": results,
                            "usage": {"total_tokens": num_tokens}, "meta": {"billed_units": {"search_units": 1}}})


async def score(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(ScoreRequest, await jsonio.read_json(request))
    pipe.require("score", "/v1/score")
    pipe.check_model(req.model)
    t1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    t2 = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    check_documents(t2, "text_2", pipe.config.max_inputs)
    if len(t1) == 1:
        t1 = t1 * len(t2)
    elif len(t1) != len(t2):
        raise ApiError(400, f"text_1 has {len(t1)} texts and text_2 {len(t2)}; send one text_1 for all of text_2, or lists of equal length", param="text_1")
    scores, num_tokens = await pipe.score(t1, t2, truncate=req.truncate, raw=req.raw_scores, instruction=req.instruction)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return jsonio.response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": pipe.info.model_name,
                            "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


ROUTES = [
    ("POST", "/v1/rerank", rerank, "cohere"),
    ("POST", "/v2/rerank", rerank, "cohere"),
    ("POST", "/v1/score", score, "openai"),
]
