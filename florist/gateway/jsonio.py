"""JSON in and out: orjson when it is installed (the `server` extra has it), else the standard library.

Requests: NaN / Infinity are not JSON and are refused (Python's json accepts them by default),
as are bodies that are not UTF-8 or nest too deeply. Responses: numpy arrays are written as
nested lists; a non-finite value is a server fault, caught before it is written.

Without orjson, float arrays (the embeddings) are not written number by number through Python
floats, which costs ~0.5 us per number (0.45 ms for one 1024-dimensional row); `float_rows`
formats the whole matrix with numpy instead, as fixed-width scientific notation with 9
significant digits, which reads back as exactly the same float32:

    row [0.125730217, -1.5e-06, 0.0]  ->  [ 1.25730217e-01,-1.50000000e-06, 0.00000000e+00]
                                          ^ a space where the sign is not '-' (JSON whitespace)
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

BACKEND = "orjson" if orjson is not None else "json"


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
    return _dumps_std(obj)


def response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


async def read_json(request: web.Request) -> Any:
    """The body as JSON; a body over the limit is a 413 (checked again while reading)."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"the request body is larger than this server takes ({e.max_size} bytes); send fewer or shorter inputs per request") from None
    return loads(body)


# -- the standard-library path --------------------------------------------------------------------
_ENCODER = json.JSONEncoder(default=_default, allow_nan=False, separators=(",", ":"))


class RawJSON(bytes):
    """Text that is JSON already (a row formatted by `float_rows`); `dumps` writes it as it is."""


def matrix_rows(m: np.ndarray) -> list:
    """The rows of a float matrix in the form `dumps` writes fastest: numpy rows for orjson,
    else all rows formatted by one `float_rows` call (per row it would cost its fixed ~30 us
    again)."""
    if orjson is not None or not _is_float32_array(m) or m.ndim != 2 or m.size == 0:
        return list(m)
    return [RawJSON(row) for row in float_rows(m)]


def _dumps_std(obj: Any) -> bytes:
    """json.dumps, except that float32 arrays are formatted by `float_rows` and RawJSON is
    written as it is. The structure around them is walked here; any part without them goes
    through the C encoder in one piece."""
    if isinstance(obj, RawJSON):
        return bytes(obj)
    if _is_float32_array(obj) and obj.ndim in (1, 2) and obj.size:
        return float_rows(obj.reshape(1, -1))[0] if obj.ndim == 1 else b"[" + b",".join(float_rows(obj)) + b"]"
    if not _has_fast_part(obj):
        return _ENCODER.encode(obj).encode()
    if isinstance(obj, dict):
        items = (_ENCODER.encode(str(k)).encode() + b":" + _dumps_std(v) for k, v in obj.items())
        return b"{" + b",".join(items) + b"}"
    return b"[" + b",".join(_dumps_std(v) for v in obj) + b"]"


def _is_float32_array(obj: Any) -> bool:
    # float64 keeps the C encoder's exact repr; float32 / float16 read back exactly either way.
    return isinstance(obj, np.ndarray) and obj.dtype in (np.float32, np.float16) and obj.ndim > 0


def _has_fast_part(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_has_fast_part(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_fast_part(v) for v in obj)
    return isinstance(obj, RawJSON) or _is_float32_array(obj)


_PLACES = 10.0 ** np.arange(8, -1, -1)[:, None]  # the place value of each of the 9 digits (exact)
_SCALES = 10.0 ** np.arange(-64, 65)  # _SCALES[64 + k] = 10**k


def float_rows(x: np.ndarray) -> list[bytes]:
    """[N, D] float32 -> N JSON arrays, each number with 9 significant digits (enough for any
    float32 to read back exactly) in fixed-width scientific notation, 16 bytes a number.
    Vectorized (about 30 numpy operations per call whatever N and D). Non-finite values raise
    ValueError, as json.dumps(allow_nan=False) does."""
    n, d = x.shape
    v = x.astype(np.float64).ravel()
    if not np.isfinite(v).all():
        raise ValueError("Out of range float values are not JSON compliant")
    a = np.abs(v)
    zero = a == 0
    exp = np.floor(np.log10(a + zero)).astype(np.int64)  # zero: exponent 0
    mant = np.rint(a * _SCALES[72 - exp])  # 9 digits: 1e8 <= mant < 1e9 (0 for zero)
    # log10 can land one off next to a power of ten, and rounding can carry into a 10th digit.
    if mant.max() >= 1e9 or np.count_nonzero(mant < 1e8) != np.count_nonzero(zero):
        exp += (mant >= 1e9).view(np.int8) - ((mant < 1e8) & ~zero).view(np.int8)
        mant = np.rint(a * _SCALES[72 - exp])
    # Integer division by exact powers of ten is exact in float64 for integers below 2**53.
    digits = np.floor(mant / _PLACES)  # digits[k] = mant // 10**(8-k)
    digits[1:] -= 10.0 * digits[:-1]  # -> the k-th digit
    digits += ord("0")
    # Built transposed (one row per character position, so every write is contiguous).
    out = np.empty((16, v.size), dtype=np.uint8)
    out[0] = np.where(np.signbit(v), ord("-"), ord(" "))
    out[1] = digits[0]
    out[2] = ord(".")
    out[3:11] = digits[1:]
    out[11] = ord("e")
    out[12] = np.where(exp < 0, ord("-"), ord("+"))
    e = np.abs(exp)
    out[13] = e // 10 + ord("0")
    out[14] = e % 10 + ord("0")
    out[15] = ord(",")
    text, width = out.T.tobytes(), d * 16
    return [b"[" + text[i * width:(i + 1) * width - 1] + b"]" for i in range(n)]
