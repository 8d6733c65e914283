"""OpenAI's completions API on a causal LM, greedy only: `POST /v1/completions`.

    {"model": "Qwen3-0.6B", "prompt": "The rose" | ["...", ...] | [ids] | [[ids], ...], "max_tokens": 16}
    -> {"id": "cmpl-...", "object": "text_completion", "created": t, "model": ...,
        "choices": [{"index": i, "text": "...", "finish_reason": "stop" | "length", "logprobs": null}],
        "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}

With `"stream": true` the answer is server-sent events, as OpenAI sends them:

    data: {"id": ..., "object": "text_completion", "created": ..., "model": ...,
           "choices": [{"index": 0, "text": " garden", "finish_reason": null, "logprobs": null}]}
    ...   (the last event of each prompt has its finish_reason)
    data: [DONE]

Decoding is greedy. OpenAI's default temperature is 1 (sampling), but this server has no sampler:
an absent temperature means greedy, and a request that asks for sampling (temperature other than
0, top_p other than 1, n / best_of other than 1, logprobs, penalties, logit_bias, seed) is refused
with a 400 rather than answered with something else than it asked for; so are `suffix` and `echo`.

Each prompt is one Generate call (the engine batches them), on the replica the balancer picks.
Streaming: the response starts once every prompt has its first tokens, so a prompt the engine
refuses (too long for its max_model_len) is still an HTTP 400; a failure after that (a replica
gone mid-stream) ends the stream with an error event `data: {"error": {...}}` and `[DONE]`.
florist extensions (vLLM's names): `stop_token_ids`, `ignore_eos`, `return_token_ids` (each
choice then carries the new `token_ids`, a final stop token included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from florist.gateway import jsonio
from florist.gateway.completion_text import CompletionText
from florist.gateway.errors import ApiError, bad_request, error_body
from florist.gateway.inputs import SHAPES, parse_inputs
from florist.gateway.pipeline import Pipeline, pipeline_of
from florist.gateway.schema import parse
from florist.gateway.tokenization import cost_chars
from florist.text import InputError

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 16  # OpenAI's
MAX_STOP_STRINGS = 4     # OpenAI's limit
_INT32_MAX = 2**31 - 1

# Sampling options and the values that leave decoding greedy (None, i.e. absent or null, always does).
GREEDY_VALUES: dict[str, tuple] = {
    "temperature": (0,), "top_p": (1,), "n": (1,), "best_of": (1,), "logprobs": (), "presence_penalty": (0,),
    "frequency_penalty": (0,), "logit_bias": ({},), "seed": (),
}
UNSUPPORTED_VALUES: dict[str, tuple] = {"suffix": ("",), "echo": (False,)}  # other features of the API


@dataclass(frozen=True)
class CompletionRequest:
    prompt: Any = field(metadata={"expects": SHAPES})
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: dict | None = field(default=None, metadata={"expects": 'an object like {"include_usage": true}'})
    stop: str | list[str] | None = None
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = field(default=None, metadata={"expects": "an object"})
    seed: int | None = None
    suffix: str | None = None
    echo: bool | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


def check_greedy(req: CompletionRequest) -> None:
    # NOTE: `in` compares with ==; parse() has checked the types, so no bool reaches a number here.
    for name, greedy in GREEDY_VALUES.items():
        value = getattr(req, name)
        if value is not None and value not in greedy:
            raise bad_request(f"only greedy decoding is supported (temperature 0); drop {name} (got {value!r:.40})", param=name)
    for name, allowed in UNSUPPORTED_VALUES.items():
        value = getattr(req, name)
        if value is not None and value not in allowed:
            raise bad_request(f"{name} is not supported by this server; drop it (got {value!r:.40})", param=name)


def _options(req: CompletionRequest, vocab_size: int) -> tuple[int, tuple[str, ...], list[int], bool]:
    """-> max_tokens, stop strings, stop token ids, include_usage."""
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1; got {max_tokens}", param="max_tokens")
    if max_tokens > _INT32_MAX:  # the engine's own check (prompt + max_tokens <= max_model_len) is far below this
        raise bad_request(f"max_tokens is {max_tokens}; the prompt and max_tokens must fit the engine's max_model_len", param="max_tokens")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS or not all(stop):
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings; got {list(stop)!r:.80}", param="stop")
    stop_ids = req.stop_token_ids or []
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids has {bad[0]}, outside the vocabulary [0, {vocab_size})", param="stop_token_ids")
    options = req.stream_options or {}
    if options and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise bad_request(f'stream_options takes only {{"include_usage": true | false}}; got {options!r:.80}', param="stream_options")
    return max_tokens, stop, stop_ids, options.get("include_usage", False)


def _encode_prompts(processor, prompts) -> list:
    """(On the pool, or inline when small.) The embedded API's tokenization (`Engine.generate` does the same)."""
    try:
        return processor.encode(prompts)
    except InputError as e:
        message = str(e)
        if message.startswith("input "):
            message = "prompt " + message.removeprefix("input ")
        hint = "; pass truncate=true to cut it"
        raise InputError(message.removesuffix(hint) + "; shorten the prompt" if message.endswith(hint) else message) from None


class _Streams:
    """One Generate stream per prompt, pumped concurrently into one queue of (prompt index, chunk or error)."""

    def __init__(self, pipe: Pipeline, prompts: list, **options):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, pipe.dispatcher.generate(ids, **options))) for i, ids in enumerate(prompts)]

    async def _pump(self, i: int, chunks) -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self.queue.put_nowait((i, chunk))
        except Exception as e:  # handed to the route, which answers it in the API's shape
            self.queue.put_nowait((i, e))

    async def next(self, choices: list[CompletionText]) -> tuple[int, Any]:
        """The next chunk of a choice that is not finished; a stream's error is raised."""
        while True:
            i, item = await self.queue.get()
            if choices[i].finished:  # queued after a stop string ended it
                continue
            if isinstance(item, Exception):
                raise item
            return i, item

    def stop(self, i: int) -> None:
        self.tasks[i].cancel()  # cancels the RPC: the engine frees the sequence's slot

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def completions(request: web.Request) -> web.StreamResponse:
    pipe = pipeline_of(request)
    req = parse(CompletionRequest, await jsonio.read_json(request))
    pipe.require("generate", "/v1/completions")
    pipe.check_model(req.model)
    check_greedy(req)
    max_tokens, stop, stop_ids, include_usage = _options(req, pipe.info.vocab_size)
    prompts = parse_inputs(req.prompt, field="prompt", input_format="json", max_inputs=pipe.config.max_inputs)
    started = time.perf_counter()
    ids = await pipe.tokenization.run(_encode_prompts, pipe.processor, prompts, chars=cost_chars(prompts))
    pipe.metrics.observe_tokens(sum(len(x) for x in ids), time.perf_counter() - started)
    choices = [CompletionText(pipe.tokenization.detokenizer(), stop) for _ in ids]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": pipe.info.model_name}
    prompt_tokens = sum(len(x) for x in ids)
    streams = _Streams(pipe, ids, max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos)
    try:
        if req.stream:
            return await _stream(request, streams, choices, head, prompt_tokens if include_usage else None, req.return_token_ids)
        while not all(c.finished for c in choices):
            i, chunk = await streams.next(choices)
            choices[i].push(chunk)
            if choices[i].finished:
                streams.stop(i)  # done (a stop string may end it before the engine would)
    finally:
        await streams.close()
    out = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason, **({"token_ids": c.token_ids} if req.return_token_ids else {})}
           for i, c in enumerate(choices)]
    return jsonio.response({**head, "choices": out, "usage": _usage(prompt_tokens, choices)})


def _usage(prompt_tokens: int, choices: list[CompletionText]) -> dict:
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


async def _stream(request: web.Request, streams: _Streams, choices: list[CompletionText], head: dict, usage_prompt_tokens: int | None,
                  return_ids: bool) -> web.StreamResponse:
    # Until every prompt has its first chunk, an error is still an HTTP status (raised to the middleware).
    first: list = []
    waiting = set(range(len(choices)))
    while waiting:
        i, chunk = await streams.next(choices)
        waiting.discard(i)
        first.append((i, chunk))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await response.prepare(request)
    extra = {"usage": None} if usage_prompt_tokens is not None else {}

    async def send(obj) -> None:
        await response.write(b"data: " + jsonio.dumps(obj) + b"\n\n")

    try:
        error = None
        try:
            pending = iter(first)
            while not all(c.finished for c in choices):
                i, chunk = next(pending, None) or await streams.next(choices)
                choice = choices[i]
                if choice.finished:  # a stop string in an earlier first chunk
                    continue
                text = choice.push(chunk)
                if choice.finished:
                    streams.stop(i)
                if text or choice.finished or return_ids:
                    event = {"index": i, "text": text, "logprobs": None, "finish_reason": choice.finish_reason}
                    await send({**head, "choices": [{**event, **({"token_ids": chunk.token_ids} if return_ids else {})}], **extra})
            if usage_prompt_tokens is not None:
                await send({**head, "choices": [], "usage": _usage(usage_prompt_tokens, choices)})
        except ApiError as e:
            error = e
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("unexpected error while streaming a completion")
            error = ApiError(500, "the gateway failed while streaming (see its log); retry, or report it if it repeats")
        if error is not None:
            await send(error_body("openai", error))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; the streams are closed by the caller
        pass
    return response


ROUTES = [("POST", "/v1/completions", completions, "openai")]
