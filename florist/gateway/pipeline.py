"""What every route shares: tokenize on the pool, send to the replicas, check what comes back.

Routes (openai.py, completions.py, tei.py, rerank.py) only translate their API's shapes; the rules live here
once, so `/v1/embeddings`, `/embed` and the embedded API give the same numbers for the same
input, and `/rerank`, `/v1/rerank` and `/v1/score` the same scores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from florist.busy_poll import IdleFlag
from florist.engine.output import check_output_options
from florist.gateway.dispatch import Dispatcher
from florist.gateway.errors import ApiError
from florist.gateway.tokenization import Tokenization
from florist.text import InputError

# Cohere/Voyage-style input types -> the sentence-transformers prompt names they mean.
INPUT_TYPES = {"query": "query", "search_query": "query", "document": "document", "search_document": "document", "passage": "document"}
# What each engine task is, and the routes that serve it (for "wrong kind of model" answers).
TASK_MODELS = {"embed": "an embedding model", "score": "a cross-encoder or reranker", "generate": "a causal LM"}
TASK_ROUTES = {"embed": "/v1/embeddings or /embed", "score": "/rerank, /v1/rerank or /v1/score", "generate": "/v1/completions"}


@dataclass
class Embeddings:
    matrix: np.ndarray  # [N, D] float32, or int8 / uint8 for the packed encodings
    num_tokens: int


class Pipeline:
    def __init__(self, info, tokenization: Tokenization, dispatcher: Dispatcher, config, metrics):
        self.info, self.tokenization, self.dispatcher, self.config, self.metrics = info, tokenization, dispatcher, config, metrics
        self.processor = tokenization.processor
        self.balancer = dispatcher.balancer
        self.started = time.time()
        self.in_flight = 0  # HTTP requests being handled (the middleware counts them)
        self.idle = IdleFlag()  # set while in_flight is 0 (the busy-poll task turns the loop only then)

    # -- checks shared by routes -------------------------------------------------------------------
    def require(self, task: str, route: str) -> None:
        if self.info.task == task:
            return
        served = self.info.task
        raise ApiError(400, f"{route} needs {TASK_MODELS[task]}; this server serves {self.info.model_name}, {TASK_MODELS.get(served, served)}: use {TASK_ROUTES.get(served, 'GET /v1/models')}")

    def check_model(self, name: str | None) -> None:
        """OpenAI-style `model`: the served name, or any path ending in it ("org/name")."""
        if name is None or name == self.info.model_name or name.rsplit("/", 1)[-1] == self.info.model_name:
            return
        raise ApiError(404, f"model {name!r} is not served here; this server serves {self.info.model_name!r} (GET /v1/models)", code="model_not_found", param="model")

    def prompt(self, *, prompt_name: str | None = None, prompt: str | None = None, input_type: str | None = None) -> str:
        if input_type is not None:
            if prompt_name is not None or prompt is not None:
                raise ApiError(400, "give one of input_type, prompt_name or prompt", param="input_type")
            if input_type not in INPUT_TYPES:
                raise ApiError(400, f"unknown input_type {input_type!r}; use one of {', '.join(INPUT_TYPES)} (or prompt_name for the model's own prompts)", param="input_type")
            # Lenient by design: a model without a query prompt embeds queries as they are.
            return self.processor.pipeline.prompt_dict.get(INPUT_TYPES[input_type], "")
        try:
            return self.processor.resolve_prompt(prompt_name, prompt)
        except InputError as e:
            raise ApiError(400, str(e), param="prompt_name") from None

    # -- work ------------------------------------------------------------------------------------
    async def embed(self, inputs, *, prompt: str = "", truncate: bool = False, direction: str = "right", dimensions: int | None = None,
                    normalize: bool | None = None, encoding: str = "float") -> Embeddings:
        try:
            check_output_options(self.info.dimensions, dimensions, encoding, self.info.native_int8)
        except InputError as e:
            raise ApiError(400, str(e), param="dimensions" if "dimensions" in str(e) else "encoding_format") from None
        started = time.perf_counter()
        ids = await self.tokenization.encode(inputs, prompt=prompt, truncate=truncate, direction=direction)
        num_tokens = sum(len(x) for x in ids)
        self.metrics.observe_tokens(num_tokens, time.perf_counter() - started)
        matrix = await self.dispatcher.embed(ids, dimensions=dimensions, normalize=normalize, encoding=encoding)
        _check_rows(matrix, len(ids))
        return Embeddings(matrix, num_tokens)

    async def score(self, queries: list[str], documents: list[str], *, truncate: bool = False, raw: bool = False,
                    instruction: str | None = None) -> tuple[np.ndarray, int]:
        """Scores of (queries[i], documents[i]); pairs sharing a query are templated together."""
        if self.info.dimensions != 1:
            raise ApiError(400, f"{self.info.model_name} has {self.info.dimensions} score labels; ranking needs a model with one relevance score")
        started = time.perf_counter()
        chars = sum(len(q) + len(d) for q, d in zip(queries, documents))
        ids, first = await self.tokenization.run(self._encode_pairs, queries, documents, truncate, instruction, chars=chars)
        num_tokens = sum(len(x) for x in ids)
        self.metrics.observe_tokens(num_tokens, time.perf_counter() - started)
        scores = await self.dispatcher.score(ids, first, raw=raw)
        _check_rows(scores, len(ids))
        return scores.reshape(len(ids)), num_tokens


    def _encode_pairs(self, queries: list[str], documents: list[str], truncate: bool, instruction: str | None):
        """(On the pool, or inline when small.) Pairs that share a query are templated in one call, in input order."""
        groups: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault(q, []).append(i)
        ids: list = [None] * len(documents)
        first: list[int] = [0] * len(documents)
        for q, idx in groups.items():
            try:
                g_ids, g_first = self.processor.encode_pairs(q, [documents[i] for i in idx], truncate=truncate, instruction=instruction)
            except InputError as e:
                raise InputError(f"{e} (query {q[:40]!r})" if len(groups) > 1 else str(e)) from None
            for k, i in enumerate(idx):
                ids[i], first[i] = g_ids[k], g_first[k]
        return ids, first


def _check_rows(x: np.ndarray, n: int) -> None:
    if x.shape[0] != n:
        raise ApiError(502, f"the engines answered {x.shape[0]} rows for {n} inputs; the response was dropped, retry the request")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x).reshape(n, -1).all(axis=1))[0])
        raise ApiError(500, f"the model produced a non-finite value for input {bad}; this is a fault of the model or engine, not of the request")


PIPELINE = web.AppKey("florist_pipeline", Pipeline)


def pipeline_of(request: web.Request) -> Pipeline:
    return request.app[PIPELINE]
