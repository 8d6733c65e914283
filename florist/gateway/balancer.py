"""Engine replicas: which are healthy, and which one takes the next chunk.

    pick()      the healthy replica with the fewest outstanding tokens (ties rotate), so a replica
                busy with a long chunk is skipped while a short request is served elsewhere
    mark_down() a replica whose RPC failed at the transport (refused, reset, shut down) is taken
                out at once; the chunk is retried elsewhere by the dispatcher
    probe loop  every `interval_s` each replica's Health is asked: a healthy one that fails or
                says NOT_SERVING is taken out; a down one is probed on a fresh channel (no
                reconnect back-off after a restart) and let back in once it is SERVING *and* its
                Info names the same model and tokenizer as the others (a replica restarted with
                another model would answer with wrong data)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable

import grpc

from florist.server import proto
from florist.server.client import InferenceClient

log = logging.getLogger(__name__)
IDENTITY_FIELDS = ("model_name", "task", "dimensions", "vocab_size", "max_input_tokens", "tokenizer_sha256", "normalize", "score_activation", "native_int8")


class Replica:
    def __init__(self, address: str, client_factory: Callable[[str], InferenceClient]):
        self.address, self._factory = address, client_factory
        self.client = client_factory(address)
        self.healthy = False
        self.outstanding_tokens = 0
        self.last_error = "not checked yet"
        self.incompatible: str | None = None

    def reconnect(self, grace_s: float) -> None:
        """A fresh channel; the old one closes once its calls are done (or after grace_s)."""
        old, self.client = self.client, self._factory(self.address)
        asyncio.get_running_loop().create_task(old.close(grace_s))

    def __repr__(self) -> str:
        return f"Replica({self.address}, {'up' if self.healthy else 'down'}, {self.outstanding_tokens} tokens)"


class Balancer:
    wait_report_s = 15.0  # while start() waits for a first replica, how often it logs what it meets

    def __init__(self, addresses: Iterable[str], *, interval_s: float = 1.0, probe_timeout_s: float = 5.0, close_grace_s: float = 60.0,
                 client_factory: Callable[[str], InferenceClient] = InferenceClient, on_change: Callable[[Replica], None] | None = None):
        self.replicas = [Replica(a, client_factory) for a in addresses]
        if not self.replicas:
            raise ValueError("no engine replicas given")
        self.interval_s, self.probe_timeout_s, self.close_grace_s = interval_s, probe_timeout_s, close_grace_s
        self.on_change = on_change or (lambda r: None)
        self.info = None  # the InfoResponse every replica must match
        self._next = 0
        self._task: asyncio.Task | None = None

    # -- choosing -------------------------------------------------------------------------------
    def pick(self, exclude: Iterable[Replica] = ()) -> Replica | None:
        n = len(self.replicas)
        self._next = (self._next + 1) % n
        best = None
        for k in range(n):
            r = self.replicas[(self._next + k) % n]
            if r.healthy and r not in exclude and (best is None or r.outstanding_tokens < best.outstanding_tokens):
                best = r
        return best

    @property
    def healthy_count(self) -> int:
        return sum(r.healthy for r in self.replicas)

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("engine replica %s taken out: %s", replica.address, reason)
        self._set(replica, False, reason)

    def _set(self, replica: Replica, healthy: bool, error: str = "") -> None:
        changed = replica.healthy != healthy
        replica.healthy, replica.last_error = healthy, error
        if changed:
            self.on_change(replica)

    # -- health ---------------------------------------------------------------------------------
    async def start(self, timeout_s: float):
        """Probe until one replica is up (-> its Info); refuse replicas serving another model."""
        deadline = time.monotonic() + timeout_s
        next_report = time.monotonic() + self.wait_report_s
        for attempt in itertools.count():
            await asyncio.gather(*(self.probe(r) for r in self.replicas))
            bad = [r for r in self.replicas if r.incompatible]
            if bad:
                raise ValueError("; ".join(r.incompatible for r in bad))
            if self.healthy_count:
                break
            now = time.monotonic()
            errors = "; ".join(f"{r.address}: {r.last_error}" for r in self.replicas)
            if now > deadline:
                raise ConnectionError(f"no engine replica answered within {timeout_s:.0f} s ({errors}); start one with `florist engine-server`")
            if attempt == 0:
                log.info("waiting up to %.0f s for an engine replica at %s", timeout_s, ", ".join(r.address for r in self.replicas))
            elif now >= next_report:  # what the wait meets, while it lasts
                log.info("still no engine replica, %.0f s left (%s)", deadline - now, errors)
                next_report = now + self.wait_report_s
            await asyncio.sleep(0.2)
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self.info

    async def probe(self, r: Replica) -> None:
        if not r.healthy:
            r.reconnect(self.close_grace_s)
        try:
            health = await r.client.health(timeout=self.probe_timeout_s)
            if health.status != proto.HealthResponse.SERVING:
                return self.mark_down(r, "the engine says NOT_SERVING (shutting down?)")
            if not r.healthy:
                self._check_identity(r, await r.client.info(timeout=self.probe_timeout_s))
        except grpc.aio.AioRpcError as e:
            return self.mark_down(r, f"{e.code().name}: {e.details()}")
        except _Incompatible as e:
            if r.incompatible != str(e):
                log.error("%s", e)
            r.incompatible = str(e)
            return self.mark_down(r, str(e))
        if not r.healthy:
            log.info("engine replica %s is serving", r.address)
        self._set(r, True)

    def _check_identity(self, r: Replica, info) -> None:
        if self.info is None:
            self.info = info
            return
        for name in IDENTITY_FIELDS:
            mine, theirs = getattr(self.info, name), getattr(info, name)
            if mine != theirs:
                raise _Incompatible(f"engine replica {r.address} serves another model ({name} {theirs!r}, the others {mine!r}); every replica must load the same model")
        r.incompatible = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await asyncio.gather(*(r.client.close() for r in self.replicas), return_exceptions=True)


class _Incompatible(Exception):
    pass
