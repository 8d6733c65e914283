"""The aiohttp application: routes of every API family behind one middleware.

The middleware, in order: API key (401), declared body size (413), the handler; then any
`ApiError` (or aiohttp's own 404 / 405 / 413) is rendered in the shape of the API family the
route belongs to (errors.py), and the request is counted in the metrics. An unexpected
exception is logged and answered 500 without its traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from florist.gateway import completions, jsonio, metrics, openai, rerank, tei
from florist.gateway.errors import ApiError, error_body, family_of_path
from florist.gateway.pipeline import PIPELINE, Pipeline

log = logging.getLogger(__name__)
ROUTE_MODULES = (openai, completions, tei, rerank, metrics)
OPEN_PATHS = frozenset({"/health"})  # no key needed: load balancers and orchestrators probe it
FAMILIES = web.AppKey("florist_families", dict)


def make_app(pipeline: Pipeline) -> web.Application:
    config = pipeline.config
    app = web.Application(client_max_size=config.payload_limit_bytes, middlewares=[_guard])
    app[PIPELINE] = pipeline
    families: dict[str, str] = {}
    for module in ROUTE_MODULES:
        for method, path, handler, family in module.ROUTES:
            route = app.router.add_route(method, path, handler)
            families[route.resource.canonical] = family
    app[FAMILIES] = families
    return app


@web.middleware
async def _guard(request: web.Request, handler) -> web.StreamResponse:
    started = time.perf_counter()
    pipeline = request.app[PIPELINE]
    resource = getattr(request.match_info.route, "resource", None)
    route = resource.canonical if resource is not None else "unmatched"
    family = request.app[FAMILIES].get(route) or family_of_path(request.path)
    pipeline.in_flight += 1
    pipeline.idle.clear()
    try:
        _authorize(request, pipeline.config.api_key)
        limit = pipeline.config.payload_limit_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body has {request.content_length} bytes; this server takes at most {limit}; send fewer or shorter inputs per request")
        response = await handler(request)
    except ApiError as e:
        response = _render(family, e)
    except web.HTTPException as e:  # the router's 404 / 405, aiohttp's 413
        response = _render(family, _from_http(e, request, pipeline.config.payload_limit_bytes))
    except asyncio.CancelledError:  # the client went away; its chunks were cancelled with it
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        response = _render(family, ApiError(500, "the gateway failed on this request (see its log); retry, or report it if it repeats"))
    finally:
        pipeline.in_flight -= 1
        if not pipeline.in_flight:
            pipeline.idle.set()
    pipeline.metrics.observe_request(route, response.status, time.perf_counter() - started)
    return response


def _authorize(request: web.Request, api_key: str | None) -> None:
    if api_key is None or request.path in OPEN_PATHS:
        return
    header = request.headers.get("Authorization")
    if not header:
        raise ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "the API key is wrong; send 'Authorization: Bearer <key>' with the key the server was started with")


def _from_http(e: web.HTTPException, request: web.Request, limit: int) -> ApiError:
    if e.status == 404:
        routes = sorted({f"{r.method} {r.resource.canonical}" for r in request.app.router.routes() if r.method != "HEAD"})
        return ApiError(404, f"no route {request.method} {request.path}; this server has: {', '.join(routes)}")
    if e.status == 405:
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ())))
        return ApiError(405, f"{request.path} does not take {request.method}; use {allowed}")
    if e.status == 413:
        return ApiError(413, f"the request body is larger than this server takes ({limit} bytes); send fewer or shorter inputs per request")
    return ApiError(e.status, e.reason or "error")


def _render(family: str, e: ApiError) -> web.Response:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return jsonio.response(error_body(family, e), status=e.status, headers=headers)
