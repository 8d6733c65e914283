"""JSON in and out: the standard library, or orjson when it is installed (faster; optional).

Requests: NaN / Infinity are not JSON and are refused (Python's json accepts them by default),
as are bodies that are not UTF-8 or nest too deeply. Responses: numpy arrays are written as
nested lists; a non-finite value is a server fault, caught before it is written.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from aiohttp import web

from florist.gateway.errors import ApiError

try:
    import orjson
except ImportError:  # pragma: no cover - not on every image
    orjson = None


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON; send finite numbers")


def loads(body: bytes) -> Any:
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object (Content-Type: application/json)")
    try:
        if orjson is not None:
            return orjson.loads(body)
        return json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 ({e}); send JSON text in UTF-8") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply to parse; send a flat JSON object") from None
    except ValueError as e:  # json.JSONDecodeError and orjson.JSONDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


def _default(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
    if orjson is not None:
        return orjson.dumps(obj, default=_default, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, default=_default, allow_nan=False, separators=(",", ":")).encode()


def response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


async def read_json(request: web.Request) -> Any:
    """The body as JSON; a body over the limit is a 413 (checked again while reading)."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"the request body is larger than this server takes ({e.max_size} bytes); send fewer or shorter inputs per request") from None
    return loads(body)
