"""Gateway parts without sockets: request models, input shapes, chunking, the balancer and the
dispatcher's failover (with fake replicas), error bodies."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from typing import Literal

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from florist.gateway.balancer import Balancer
from florist.gateway.chunking import parts_for, split
from florist.gateway.dispatch import ChunkLimits, Dispatcher
from florist.gateway.errors import ApiError, error_body
from florist.gateway.inputs import parse_inputs
from florist.gateway.schema import parse
from florist.server import proto


# -- request models -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    query: str
    texts: list[str]
    top_n: int | None = None
    scale: float = 1.0
    mode: Literal["a", "b"] = "a"
    flag: bool = False


@pytest.mark.parametrize("body,message", [
    ([], "must be a JSON object with the fields query, texts"),
    ({"texts": []}, "missing field 'query': it must be a string"),
    ({"query": 1, "texts": []}, "query must be a string; got an integer (1)"),
    ({"query": "q", "texts": "t"}, "texts must be a list of strings; got a string"),
    ({"query": "q", "texts": ["a", 2]}, "texts must be a list of strings; got an array"),
    ({"query": "q", "texts": [], "top_n": True}, "top_n must be an integer or null; got a boolean"),
    ({"query": "q", "texts": [], "top_n": 1.5}, "top_n must be an integer or null; got a number"),
    ({"query": "q", "texts": [], "mode": "c"}, "mode must be one of 'a', 'b'; got a string ('c')"),
    ({"query": "q", "texts": [], "flag": "yes"}, "flag must be a boolean"),
    ({"query": "q", "texts": [], "topn": 3}, "unknown field 'topn'; this route takes: query, texts, top_n, scale, mode, flag"),
])
def test_parse_refuses_with_a_message(body, message):
    with pytest.raises(ApiError) as err:
        parse(Example, body)
    assert err.value.status == 400 and message in err.value.message


def test_parse_accepts_and_defaults():
    got = parse(Example, {"query": "q", "texts": ["a"], "scale": 2, "top_n": None})
    assert got == Example("q", ["a"], None, 2, "a", False)


# -- inputs ---------------------------------------------------------------------------------------
def test_input_shapes():
    assert parse_inputs("a", field="input", input_format="json", max_inputs=4) == ["a"]
    assert parse_inputs(["a", "b"], field="input", input_format="json", max_inputs=4) == ["a", "b"]
    (one,) = parse_inputs([1, 2, 3], field="input", input_format="json", max_inputs=4)
    assert one.tolist() == [1, 2, 3]
    assert [x.tolist() for x in parse_inputs([[1], [2, 3]], field="input", input_format="json", max_inputs=4)] == [[1], [2, 3]]
    packed = [base64.b64encode(np.asarray(ids, "<i4").tobytes()).decode() for ids in ([5, 6], [7])]
    assert [x.tolist() for x in parse_inputs(packed, field="input", input_format="base64", max_inputs=4)] == [[5, 6], [7]]


@pytest.mark.parametrize("value,fmt,message", [
    ({}, "json", "input must be a string, a list of strings, a list of token ids or a list of token-id lists; got an object"),
    ([], "json", "input is empty"),
    (["a", 1], "json", "input[1] is an integer; inputs must all be strings"),
    ([[1], "a"], "json", "input[1] is a string; inputs must all be token-id lists"),
    ([[1, 2.5]], "json", "input[0] must be a list of integer token ids; it holds a number (2.5)"),
    ([[1, True]], "json", "it holds a boolean"),
    ([[10**30]], "json", "too large for any vocabulary"),
    (["a"] * 5, "json", "input has 5 inputs; this server takes at most 4 per request"),
    (["@@@"], "base64", "input[0] is not valid base64"),
    (["AQID"], "base64", "decodes to 3 bytes, not a multiple of 4"),
    ([1], "base64", 'with input_format "base64", input must be a base64 string'),
])
def test_bad_inputs(value, fmt, message):
    with pytest.raises(ApiError) as err:
        parse_inputs(value, field="input", input_format=fmt, max_inputs=4)
    assert err.value.status == 400 and message in err.value.message, err.value.message


# -- chunking -------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(1, 600), min_size=1, max_size=80), max_seqs=st.integers(1, 40), max_tokens=st.integers(1, 2000), min_parts=st.integers(1, 6))
def test_split_covers_in_order_within_bounds(lens, max_seqs, max_tokens, min_parts):
    bounds = split(lens, max_seqs=max_seqs, max_tokens=max_tokens, min_parts=min_parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(lens)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    for a, b in bounds:
        assert b - a <= max_seqs
        assert sum(lens[a:b]) <= max_tokens or b - a == 1  # only a lone over-long sequence exceeds it
    assert len(bounds) >= min(min_parts, len(lens))


def test_split_balances_tokens_over_parts():
    bounds = split([100] * 40, max_seqs=256, max_tokens=16384, min_parts=2)
    assert bounds == [(0, 20), (20, 40)]
    assert split([5, 5], max_seqs=256, max_tokens=16384) == [(0, 2)]
    assert parts_for(1000, healthy_replicas=4, min_chunk_tokens=2048) == 1
    assert parts_for(10_000, healthy_replicas=4, min_chunk_tokens=2048) == 4
    assert parts_for(10_000, healthy_replicas=0, min_chunk_tokens=2048) == 1


# -- balancer and dispatcher with fake replicas ---------------------------------------------------
class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code, details="x"):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeClient:
    """A replica: answers row k of a chunk with the chunk's first id of sequence k (so order shows)."""

    behaviour: dict[str, object] = {}
    calls: list[tuple[str, int]] = []

    def __init__(self, address):
        self.address = address
        self.channel = self

    async def close(self, grace=None):
        pass

    async def health(self, timeout=None):
        fail = self.behaviour.get(("health", self.address))
        if fail:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return proto.HealthResponse(status=proto.HealthResponse.SERVING)

    async def info(self, timeout=None):
        name = self.behaviour.get(("model", self.address), "m")
        return proto.InfoResponse(model_name=name, task="embed", dimensions=1, vocab_size=100, max_input_tokens=64, tokenizer_sha256="s")

    async def embed(self, seqs, *, timeout=None, **options):
        self.calls.append((self.address, len(seqs)))
        await asyncio.sleep(0.01)
        code = self.behaviour.get(("embed", self.address))
        if code is not None:
            raise FakeRpcError(code, "gone")
        return np.asarray([[float(s[0])] for s in seqs], dtype=np.float32)


def run(coro):
    return asyncio.run(coro)


async def make(addresses, behaviour, max_seqs=2):
    FakeClient.behaviour, FakeClient.calls = dict(behaviour), []
    balancer = Balancer(addresses, client_factory=FakeClient, interval_s=0.05)
    await balancer.start(timeout_s=1)
    return balancer, Dispatcher(balancer, ChunkLimits(max_seqs=max_seqs, max_tokens=1000, min_tokens=1), timeout_s=5)


def seqs(n):
    return [np.asarray([i, 1, 2]) for i in range(n)]


def test_chunks_spread_over_replicas_and_come_back_in_order():
    async def go():
        balancer, d = await make(["a", "b"], {})
        out = await d.embed(seqs(10), dimensions=None, normalize=None, encoding="float")
        await balancer.close()
        return out

    out = run(go())
    assert out[:, 0].tolist() == list(range(10))
    assert {a for a, _ in FakeClient.calls} == {"a", "b"} and sum(n for _, n in FakeClient.calls) == 10


def test_a_failed_replica_is_taken_out_and_its_chunks_retried_elsewhere():
    async def go():
        balancer, d = await make(["a", "b"], {("embed", "a"): grpc.StatusCode.UNAVAILABLE})
        out = await d.embed(seqs(10), dimensions=None, normalize=None, encoding="float")
        down = [r.address for r in balancer.replicas if not r.healthy]
        # The probe loop keeps "a" out while its Health fails, and lets it back in after.
        FakeClient.behaviour[("health", "a")] = True
        await asyncio.sleep(0.2)
        still_down = not balancer.replicas[0].healthy
        FakeClient.behaviour.pop(("health", "a"))
        FakeClient.behaviour.pop(("embed", "a"))
        await asyncio.sleep(0.2)
        back = balancer.replicas[0].healthy
        await balancer.close()
        return out, down, still_down, back

    out, down, still_down, back = run(go())
    assert out[:, 0].tolist() == list(range(10))
    assert down == ["a"] and still_down and back


def test_no_replica_left_is_503_and_overload_is_429():
    async def go(behaviour):
        balancer, d = await make(["a", "b"], behaviour)
        try:
            await d.embed(seqs(3), dimensions=None, normalize=None, encoding="float")
        finally:
            await balancer.close()

    with pytest.raises(ApiError) as err:
        run(go({("embed", "a"): grpc.StatusCode.UNAVAILABLE, ("embed", "b"): grpc.StatusCode.CANCELLED}))
    assert err.value.status == 503 and err.value.retry_after_s == 1
    with pytest.raises(ApiError) as err:
        run(go({("embed", "a"): grpc.StatusCode.RESOURCE_EXHAUSTED, ("embed", "b"): grpc.StatusCode.RESOURCE_EXHAUSTED}))
    assert err.value.status == 429 and "overloaded" in err.value.message
    with pytest.raises(ApiError) as err:  # an engine error is not retried: it may well repeat
        run(go({("embed", "a"): grpc.StatusCode.INTERNAL, ("embed", "b"): grpc.StatusCode.INTERNAL}))
    assert err.value.status == 500 and len(FakeClient.calls) <= 2


def test_least_outstanding_tokens_wins():
    async def go():
        balancer, _ = await make(["a", "b", "c"], {})
        a, b, c = balancer.replicas
        a.outstanding_tokens, b.outstanding_tokens, c.outstanding_tokens = 500, 20, 300
        first = balancer.pick()
        second = balancer.pick(exclude=[b])
        await balancer.close()
        return first.address, second.address

    assert run(go()) == ("b", "c")


def test_a_replica_serving_another_model_is_refused():
    async def go():
        FakeClient.behaviour = {("model", "b"): "other"}
        balancer = Balancer(["a", "b"], client_factory=FakeClient)
        try:
            await balancer.start(timeout_s=1)
        finally:
            await balancer.close()

    with pytest.raises(ValueError, match="engine replica b serves another model"):
        run(go())


def test_start_reports_what_it_meets_while_no_replica_answers(monkeypatch, caplog):
    """A gateway started before its engines (or pointed at a wrong address) says every
    wait_report_s why it still waits, then gives up at the timeout naming each replica's error."""
    monkeypatch.setattr(Balancer, "wait_report_s", 0.3)

    async def go():
        FakeClient.behaviour = {("health", "a"): True}
        balancer = Balancer(["a"], client_factory=FakeClient)
        try:
            await balancer.start(timeout_s=1.1)
        finally:
            await balancer.close()

    with caplog.at_level("INFO", logger="florist.gateway.balancer"):
        with pytest.raises(ConnectionError, match=r"no engine replica answered within 1 s \(a: UNAVAILABLE: connection refused\)"):
            run(go())
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "waiting up to 1 s for an engine replica at a"
    reports = [m for m in messages if m.startswith("still no engine replica")]
    assert 2 <= len(reports) <= 4 and all(m.endswith("s left (a: UNAVAILABLE: connection refused)") for m in reports), messages


def test_error_bodies_per_family():
    e = ApiError(429, "slow down", retry_after_s=1)
    assert error_body("openai", e) == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "overloaded"}}
    assert error_body("tei", e) == {"error": "slow down", "error_type": "Overloaded"}
    assert error_body("cohere", e) == {"message": "slow down"}


# -- JSON with and without orjson ------------------------------------------------------------------
@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_json_in_and_out(monkeypatch, fast):
    from florist.gateway import jsonio

    if not fast:
        monkeypatch.setattr(jsonio, "orjson", None)
    elif jsonio.orjson is None:
        pytest.skip("orjson is not installed")
    assert jsonio.loads(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    for bad, message in ((b'{"a": NaN}', "not valid JSON"), (b'{"a": ', "not valid JSON"), (b"", "body is empty"), (b"[" * 100_000, "")):
        with pytest.raises(ApiError) as err:
            jsonio.loads(bad)
        assert err.value.status == 400 and message in err.value.message
    with pytest.raises(ApiError) as err:
        jsonio.loads(b'"\xff"')
    assert err.value.status == 400
    rows = np.asarray([[0.5, -1.25]], dtype=np.float32)
    assert json.loads(jsonio.dumps({"x": list(rows), "b": np.asarray([1, 255], np.uint8)})) == {"x": [[0.5, -1.25]], "b": [1, 255]}



def test_float_rows_read_back_exactly():
    from florist.gateway.jsonio import float_rows

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edge = np.array([0.0, -0.0, 1.0, -1.0, 0.1, 9.9999999e-1, 10.0, 1e-45, -1.4e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38,
                     123456789.0, 999999999.0, 1e-5], dtype=np.float32)
    x = np.concatenate([edge, bits[np.isfinite(bits)], rng.standard_normal(10_000).astype(np.float32)])
    x = x[: len(x) // 7 * 7].reshape(-1, 7)
    rows = float_rows(x)
    back = np.array([json.loads(r) for r in rows], dtype=np.float32)
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))  # every bit, -0.0 included
    assert rows[0] == b"[ 0.00000000e+00,-0.00000000e+00, 1.00000000e+00,-1.00000000e+00, 1.00000001e-01, 1.00000000e+00, 1.00000000e+01]"
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError):
            float_rows(np.array([[1.0, bad]], dtype=np.float32))


def test_stdlib_json_writes_float32_arrays_fast_and_everything_else_as_json_does(monkeypatch):
    from florist.gateway import jsonio

    monkeypatch.setattr(jsonio, "orjson", None)
    m = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    rows = jsonio.matrix_rows(m)
    assert all(isinstance(r, jsonio.RawJSON) for r in rows)
    obj = {"data": [{"index": i, "embedding": r} for i, r in enumerate(rows)], "matrix": m, "row": m[1], "empty": np.zeros((0, 4), np.float32),
           "other": ["x\u0000\"\u00e9", None, True, 2, 2.5, np.float32(1.5), np.arange(3), np.array([0.1]), {"k": (1, 2)}]}
    got = json.loads(jsonio.dumps(obj))
    assert np.array_equal(np.array([d["embedding"] for d in got["data"]], dtype=np.float32), m)
    assert np.array_equal(np.array(got["matrix"], dtype=np.float32), m) and np.array_equal(np.array(got["row"], dtype=np.float32), m[1])
    assert got["empty"] == [] and got["other"] == ["x\u0000\"\u00e9", None, True, 2, 2.5, 1.5, [0, 1, 2], [0.1], {"k": [1, 2]}]
    assert [d["index"] for d in got["data"]] == [0, 1, 2] and list(got) == ["data", "matrix", "row", "empty", "other"]
    with pytest.raises(ValueError):
        jsonio.dumps({"x": np.array([np.nan], np.float32)})
    if jsonio.orjson is None:
        return
    monkeypatch.undo()
    assert isinstance(jsonio.matrix_rows(m)[0], np.ndarray)  # orjson writes numpy rows itself


# -- tokenization: inline when small, else on the pool ----------------------------------------------
def test_small_tokenization_runs_on_the_loop_while_the_pool_is_idle(default_engine):
    import threading

    from florist.gateway.tokenization import IDS_CHARS, Tokenization, cost_chars

    assert cost_chars(["ab", "cde"], prompt="q: ") == 11 and cost_chars([np.arange(300), np.arange(2)]) == 2 * IDS_CHARS
    tok = Tokenization(default_engine.text, 2, inline_chars=100)
    where: list[str] = []

    def note(x):
        where.append(threading.current_thread().name)
        return x

    async def go():
        assert await tok.run(note, 1, chars=100) == 1  # small: right here
        await tok.run(note, 2, chars=101)  # too large
        await tok.run(note, 3)  # size unknown
        gate = threading.Event()
        busy = asyncio.ensure_future(tok.run(gate.wait, 10))  # the pool is busy: small calls join it
        await asyncio.sleep(0.05)
        await tok.run(note, 4, chars=1)
        gate.set()
        await busy
        return threading.current_thread().name

    try:
        loop_thread = run(go())
        assert where[0] == loop_thread and all(w.startswith("florist-tokenize") for w in where[1:]), where
        assert tok.on_pool == 0
        # The same tokens either way, and an InputError is a 400 either way.
        texts = ["a rose in the garden", "tulips"]
        assert [x.tolist() for x in run(tok.encode(texts, prompt="", truncate=False, direction="right"))] == default_engine.tokenize(texts)
        for inline_chars in (1000, 0):
            tok.inline_chars = inline_chars
            with pytest.raises(ApiError) as err:
                run(tok.encode(["a", ""], prompt="", truncate=False, direction="right"))
            assert err.value.status == 400 and "input 1 is an empty string" in err.value.message
    finally:
        tok.close()


def test_one_chunk_requests_skip_the_split():
    async def go():
        balancer, d = await make(["a", "b"], {}, max_seqs=4)
        d.limits = ChunkLimits(max_seqs=4, max_tokens=1000, min_tokens=2048)  # below: never split over replicas
        one = await d.embed(seqs(4), dimensions=None, normalize=None, encoding="float")
        calls = list(FakeClient.calls)
        five = await d.embed(seqs(5), dimensions=None, normalize=None, encoding="float")  # over max_seqs: two chunks
        await balancer.close()
        return one, calls, five

    one, calls, five = run(go())
    assert one[:, 0].tolist() == [0, 1, 2, 3] and len(calls) == 1 and calls[0][1] == 4
    assert five[:, 0].tolist() == [0, 1, 2, 3, 4] and sorted(n for _, n in FakeClient.calls[1:]) == [2, 3]

def test_serve_passes_engine_options_to_its_engine_servers(monkeypatch):
    import florist.gateway.supervisor as supervisor
    from florist.cli import main

    seen = {}

    def fake_serve(config, *, workers, engine_args, device, replicas, tensor_parallel):
        seen.update(engine_args=engine_args, workers=workers, config=config, tensor_parallel=tensor_parallel)
        return 0

    monkeypatch.setattr(supervisor, "serve", fake_serve)
    assert main(["serve", "--model", "/m", "--task", "score", "--max-pending-tokens", "123", "--max-batch-tokens", "456"]) == 0
    args = seen["engine_args"]
    assert args[args.index("--task") + 1] == "score"
    assert args[args.index("--max-pending-tokens") + 1] == "123" and args[args.index("--max-batch-tokens") + 1] == "456"
    assert "--tensor-parallel-size" not in args and seen["tensor_parallel"] == 1
    assert main(["serve", "--model", "/m"]) == 0 and "--task" not in seen["engine_args"] and "--attention-backend" not in seen["engine_args"]
    assert main(["serve", "--model", "/m", "--attention-backend", "flex"]) == 0
    assert seen["engine_args"][seen["engine_args"].index("--attention-backend") + 1] == "flex"
    assert main(["serve", "--model", "/lm", "--tensor-parallel-size", "2"]) == 0  # placement and the engines' own flag
    assert seen["tensor_parallel"] == 2 and seen["engine_args"][seen["engine_args"].index("--tensor-parallel-size") + 1] == "2"
    assert "--no-warm-up" not in seen["engine_args"]  # the engine server's default: warm up
    assert main(["serve", "--model", "/m", "--no-warm-up"]) == 0 and "--no-warm-up" in seen["engine_args"]


def test_serve_shares_the_cpus_between_the_workers_tokenizer_threads(monkeypatch):
    import os

    import florist.gateway.supervisor as supervisor
    from florist.cli import main

    seen = {}
    monkeypatch.setattr(supervisor, "serve", lambda config, **kw: seen.update(config=config, **kw) or 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    for workers, threads in ((1, 4), (4, 4), (8, 2), (32, 1)):
        assert main(["serve", "--model", "/m", "--workers", str(workers)]) == 0
        assert seen["workers"] == workers and seen["config"].tokenization_workers == threads and seen["config"].reuse_port == (workers > 1)
    assert main(["serve", "--model", "/m", "--workers", "8", "--tokenization-workers", "3"]) == 0 and seen["config"].tokenization_workers == 3
    assert main(["serve", "--model", "/m", "--tokenization-workers", "0"]) == 2


def test_replica_placement_with_tensor_parallelism(monkeypatch):
    """One replica per GPU by default; at --tensor-parallel-size N each takes N GPUs, which become
    its whole view of the GPUs (through this process's own CUDA_VISIBLE_DEVICES)."""
    from florist.gateway import processes

    monkeypatch.setattr(processes, "_cuda_count", lambda: 4)
    plan = processes.plan_devices
    assert plan(None, None) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert plan(None, None, 2) == ["cuda:0,1", "cuda:2,3"]
    assert plan(None, 1, 4) == ["cuda:0,1,2,3"]
    assert plan("cuda:3,cuda:1", None, 2) == ["cuda:3,1"]
    assert plan("cpu", 2, 2) == ["cpu", "cpu"]  # CPU ranks share the cores (gloo)
    for device, replicas, tp, message in ((None, 3, 2, "need 6 GPUs; 4 given"), (None, None, 8, "need 8 GPUs"),
                                          ("cuda:0,cpu", None, 2, "not a mix"), (None, None, 0, "at least 1")):
        with pytest.raises(ValueError, match=message):
            plan(device, replicas, tp)
    assert processes.replica_device("cuda:2,3", {"PATH": "/bin"}) == ("cuda", {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert processes.replica_device("cuda:0,1", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})[1]["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert processes.replica_device("cuda:1", {}) == ("cuda:1", {})
    assert processes.replica_device("cpu", {}) == ("cpu", {})


def test_the_commands_refuse_ports_and_counts_out_of_range(monkeypatch, capsys):
    """A port past 65535 would be bound modulo 2^16 (99999 -> 34463) and a count of 0 read as "the
    default": both are refused by name, before any engine starts or model loads."""
    import florist
    import florist.gateway.supervisor as supervisor
    from florist.cli import main
    from florist.server import cli as engine_cli
    from florist.server.service import batch_token_budget

    seen = []
    monkeypatch.setattr(supervisor, "serve", lambda config, **kw: seen.append(config) or 0)
    for port in ("0", "8000", "65535"):
        assert main(["serve", "--model", "/m", "--port", port]) == 0 and seen[-1].port == int(port)
    for bad, says in (("99999", "99999 is not a port (0-65535"), ("-1", "-1 is not a port"), ("80a", "'80a' is not a port number")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model", "/m", "--port", bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    seen.clear()
    for flag in ("--replicas", "--workers", "--max-batch-tokens", "--max-pending-tokens", "--chunk-seqs", "--chunk-tokens", "--tokenization-workers"):
        assert main(["serve", "--model", "/m", flag, "0"]) == 2, flag
        assert f"{flag} must be at least 1; got 0" in capsys.readouterr().err
    assert main(["serve", "--engines", "127.0.0.1:50051,enginehost"]) == 2
    assert "--engines takes host:port addresses (or gRPC targets such as unix:PATH); got enginehost" in capsys.readouterr().err
    assert not seen
    assert main(["serve", "--engines", "127.0.0.1:50051, [::1]:7000,unix:/tmp/e.sock"]) == 0
    assert seen[-1].engines == ("127.0.0.1:50051", "[::1]:7000", "unix:/tmp/e.sock")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(florist.Engine, "from_pretrained", no_load)
    for flags, says in ((["--max-batch-tokens", "0"], "--max-batch-tokens must be at least 1; got 0"),
                        (["--max-batch-seqs", "-3"], "--max-batch-seqs must be at least 1; got -3"),
                        (["--max-pending-tokens", "0"], "--max-pending-tokens must be at least 1"),
                        (["--spin-ms", "-1"], "--spin-ms must be 0 or more")):
        assert engine_cli.main(["--device", "cpu", *flags]) == 2, flags
        assert says in capsys.readouterr().err
    for flag in ("--port", "--metrics-port"):
        with pytest.raises(SystemExit):
            engine_cli.main(["--device", "cpu", flag, "65536"])
        assert "65536 is not a port" in capsys.readouterr().err
    # a budget given is the budget (the scheduler refuses a bad one); none: the largest graph, else 16384
    assert batch_token_budget(object(), 100) == 100 and batch_token_budget(object(), None) == 16384
    assert batch_token_budget(type("E", (), {"graph_max_tokens": 4096})(), None) == 4096
