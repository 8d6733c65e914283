"""OpenAI-compatible routes: `POST /v1/embeddings`, `GET /v1/models`.

    {"input": "a text" | [...], "model": "all-MiniLM-L6-v2", "dimensions": 128, "encoding_format": "float" | "base64"}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...] | "<base64 float32>"}],
        "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

florist extensions (ignored by OpenAI's client unless sent with `extra_body`): `input_type`
("query" / "document", applies the model's prompt if it has one), `prompt_name`, `prompt`,
`truncate`, `truncation_direction`, `normalize`, `input_format: "base64"` (token ids as base64
int32), and `encoding_format` "int8" (models that define it), "binary", "ubinary" (packed bits).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from florist.gateway import jsonio
from florist.gateway.inputs import SHAPES, parse_inputs
from florist.gateway.pipeline import pipeline_of
from florist.gateway.schema import parse


@dataclass(frozen=True)
class EmbeddingsRequest:
    input: Any = field(metadata={"expects": SHAPES})
    model: str | None = None
    dimensions: int | None = None
    encoding_format: Literal["float", "base64", "int8", "binary", "ubinary"] = "float"
    user: str | None = None
    input_type: str | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    truncate: bool = False
    truncation_direction: Literal["right", "left"] = "right"
    normalize: bool | None = None
    input_format: Literal["json", "base64"] = "json"


async def embeddings(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    req = parse(EmbeddingsRequest, await jsonio.read_json(request))
    pipe.require("embed", "/v1/embeddings")
    pipe.check_model(req.model)
    inputs = parse_inputs(req.input, field="input", input_format=req.input_format, max_inputs=pipe.config.max_inputs)
    prompt = pipe.prompt(prompt_name=req.prompt_name, prompt=req.prompt, input_type=req.input_type)
    fmt = req.encoding_format
    out = await pipe.embed(inputs, prompt=prompt, truncate=req.truncate, direction=req.truncation_direction,
                           dimensions=req.dimensions, normalize=req.normalize, encoding="float" if fmt == "base64" else fmt)
    m = out.matrix
    if fmt == "base64":  # little-endian float32, what OpenAI's client decodes
        rows = [base64.b64encode(m[i].astype("<f4", copy=False).tobytes()).decode("ascii") for i in range(len(m))]
    else:
        rows = jsonio.matrix_rows(m)
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    usage = {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens}
    return jsonio.response({"object": "list", "data": data, "model": pipe.info.model_name, "usage": usage})


def _model_card(pipe) -> dict:
    return {"id": pipe.info.model_name, "object": "model", "created": int(pipe.started), "owned_by": "florist"}


async def models(request: web.Request) -> web.Response:
    return jsonio.response({"object": "list", "data": [_model_card(pipeline_of(request))]})


async def model(request: web.Request) -> web.Response:
    pipe = pipeline_of(request)
    pipe.check_model(request.match_info["name"])
    return jsonio.response(_model_card(pipe))


ROUTES = [
    ("POST", "/v1/embeddings", embeddings, "openai"),
    ("GET", "/v1/models", models, "openai"),
    ("GET", "/v1/models/{name:.+}", model, "openai"),
]
