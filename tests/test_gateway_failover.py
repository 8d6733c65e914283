"""Two engine replicas behind `florist serve --engines`; one is SIGKILLed in the middle of a load.

Every request must either succeed with exactly the embedded API's numbers (its chunks retried on
the surviving replica) or get a clear 5xx; none may be answered with wrong data. The killed
replica is then restarted on its port and the gateway probes it back into rotation.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
from florist_procs import engine_servers, serve
from test_gateway import TOL, call

WORDS = ["rose", "tulip", "seed", "soil", "water", "sun", "rain", "green", "garden", "search", "engine", "model", "text"]


def test_killing_a_replica_mid_load_loses_no_request(default_engine):
    (a, addr_a), (b, addr_b) = engine_servers(2)
    gw, url = serve("--engines", f"{addr_a},{addr_b}", "--chunk-seqs", "2")
    restarted = None
    try:
        rng = np.random.default_rng(7)
        pool = [" ".join(rng.choice(WORDS, size=rng.integers(2, 40))) for _ in range(200)]
        want = dict(zip(pool, default_engine.embed(pool)))
        load_s, kill_at_s = 5.0, 1.5

        async def client(session, k, results):
            r = np.random.default_rng(k)
            started = time.monotonic()
            while time.monotonic() - started < load_s:
                texts = [pool[i] for i in r.integers(0, len(pool), size=r.integers(1, 9))]
                sent = time.monotonic()
                async with session.post(url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}) as resp:
                    results.append((sent, texts, resp.status, await resp.json()))

        async def load():
            results = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                tasks = [asyncio.ensure_future(client(session, k, results)) for k in range(12)]
                await asyncio.sleep(kill_at_s)
                a.proc.kill()  # SIGKILL: no goodbye, in-flight calls are cut
                killed = time.monotonic()
                await asyncio.gather(*tasks)
            return results, killed

        results, killed = asyncio.run(load())
        ok = [r for r in results if r[2] == 200]
        failed = [r for r in results if r[2] != 200]
        for _, texts, status, body in ok:
            got = np.array([d["embedding"] for d in body["data"]])
            np.testing.assert_allclose(got, np.stack([want[t] for t in texts]), **TOL)
        after = [r for r in ok if r[0] > killed + 0.2]
        print(f"{len(results)} requests, {len(ok)} answered 200, {len(after)} of them sent after the kill; failures: {[f[2] for f in failed]}")
        assert not failed and len(after) >= 10, (len(ok), len(results), len(after), [f[2:] for f in failed[:3]])  # a chunk cut by the kill is sent again

        metrics = call(url, "/info")[2]["replicas"]
        assert metrics == {"total": 2, "healthy": 1}
        # The replica comes back on its port; the gateway lets it back in.
        ((restarted, _),) = engine_servers(1, port=int(addr_a.rsplit(":", 1)[1]))
        deadline = time.monotonic() + 20
        while call(url, "/info")[2]["replicas"]["healthy"] != 2:
            assert time.monotonic() < deadline, "the restarted replica was not probed back in"
            time.sleep(0.2)
        status, _, body = call(url, "/embed", {"inputs": pool[:8]})
        assert status == 200
        np.testing.assert_allclose(body, np.stack([want[t] for t in pool[:8]]), **TOL)
    finally:
        for p in (gw, a, b, restarted):
            if p is not None:
                p.stop()
