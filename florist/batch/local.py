"""The job on this machine: one engine, three threads so the device never waits on the host.

    reader thread   read part k+1, tokenize it            (file I/O, tokenizers: GIL released)
    main thread     engine.run(part k)                    (batches by length, two in flight)
    writer thread   finish part k-1, write it, append it  (numpy, Parquet: GIL mostly released)

Each queue holds one part, so at most three parts are in memory. The engine sorts a part by
length and cuts it into token-budget batches; a part is thousands of documents, so the batches
are dense, and its output comes back in input order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from florist.batch.embedder import Embed, OutputOptions, Tokenize
from florist.batch.plan import InputPlan, InputSpec
from florist.batch.reader import read_part
from florist.batch.store import PartResult

_DONE = object()


class LocalRunner:
    def __init__(self, cfg, spec: InputSpec, engine=None):
        if engine is None:
            from florist import Engine

            engine = Engine.from_pretrained(cfg.model, device=cfg.device, dtype=cfg.dtype, max_batch_tokens=cfg.batch_tokens)
        self.spec, self.engine = spec, engine
        self.model_dir, self.text = engine.model_dir, engine.text
        self.model_dim, self.dtype = engine.info.dimensions, engine.info.dtype

    def run(self, plan: InputPlan, pending: list[int], tokenize: Tokenize, output: OutputOptions, sink) -> None:
        embed = Embed(self.engine, output)

        def prepare(k: int):
            return tokenize(read_part(self.spec, plan, k))

        def write(item) -> None:
            k, tokenized, vectors = item
            sink.write(PartResult.from_rows(k, plan.part_records(k), embed.finish(tokenized, vectors)))

        with Ahead(prepare, pending) as parts, Behind(write) as writer:
            for k, tokenized in parts:
                sink.check(tokenized)
                writer.put((k, tokenized, embed.run(tokenized)))

    def close(self) -> None:
        pass


class Ahead:
    """Iterate (k, prepare(k)) with prepare running one item ahead in a thread."""

    def __init__(self, prepare: Callable, keys: Iterable):
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(prepare, list(keys)), name="florist-embed-reader", daemon=True)

    def _work(self, prepare: Callable, keys: list) -> None:
        try:
            for k in keys:
                if not self._put((k, prepare(k))):
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(e)
            return
        self._put(_DONE)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __enter__(self):
        self._thread.start()
        return self

    def __iter__(self):
        while (item := self._q.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Behind:
    """Run `consume(item)` in a thread, one item queued; its error surfaces at the next put or
    at exit. Exit drains the queue first, so items already handed over are always finished."""

    def __init__(self, consume: Callable):
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, args=(consume,), name="florist-embed-writer", daemon=True)

    def _work(self, consume: Callable) -> None:
        while (item := self._q.get()) is not _DONE:
            if self._error is None:
                try:
                    consume(item)
                except BaseException as e:
                    self._error = e

    def put(self, item) -> None:
        self._raise()
        self._q.put(item)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._q.put(_DONE)
        self._thread.join()
        if exc is None:
            self._raise()
