"""The output directory of a batch job; the only code that writes into it.

    OUTPUT/
      manifest.json             input identity, options, part plan; "state": "running" | "complete"
      parts/part-00000.parquet  one per part: line, id, embedding; the part's counts and skipped
      parts/part-00001.parquet  records in the file's key-value metadata ("florist.part")
      embeddings.parquet        once complete: id, embedding, in input order (one row group per part)
      skipped.jsonl             once complete: {"line" | "row": N, "error": "..."} per skipped record

Every file appears by rename after fsync, so a file that exists is whole. A part file on disk *is*
the record that its part is done: resuming trusts the part files, never a list kept elsewhere, so
a kill between any two writes loses at most the part in flight and duplicates nothing. A killed
run leaves only `.NAME.tmp-PID` files, which the next run removes (it holds the directory's lock).
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from florist.text import InputError

MANIFEST, RESULT, SKIPPED = "manifest.json", "embeddings.parquet", "skipped.jsonl"
_PART_KEY = b"florist.part"


@dataclass
class PartStats:
    part: int
    records: int  # records of the input in this part: rows + skipped + blank
    rows: int  # documents embedded
    blank: int
    tokens: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line or row, error)


@dataclass
class PartResult:
    stats: PartStats
    table: pa.Table  # line, id, embedding: the documents, in input order

    @classmethod
    def from_rows(cls, part: int, records: int, rows: pa.Table) -> PartResult:
        """rows: Embed's output for the whole part (any chunking), in input order."""
        if rows.num_rows != records:
            raise RuntimeError(f"part {part} has {rows.num_rows} result rows for {records} records")
        is_doc = pc.is_valid(rows.column("embedding"))
        errors = rows.filter(pc.is_valid(rows.column("error")))
        skipped = list(zip(errors.column("line").to_pylist(), errors.column("error").to_pylist()))
        docs = rows.filter(is_doc).select(["line", "id", "embedding"])
        tokens = int(pc.sum(rows.column("tokens")).as_py() or 0)
        stats = PartStats(part, records, docs.num_rows, records - docs.num_rows - len(skipped), tokens, skipped)
        return cls(stats, docs)


@dataclass
class Totals:
    rows: int = 0
    skipped: int = 0
    blank: int = 0
    tokens: int = 0

    def add(self, s: PartStats) -> None:
        self.rows += s.rows
        self.skipped += len(s.skipped)
        self.blank += s.blank
        self.tokens += s.tokens


def temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def commit(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it to `final`, fsync the directory: `final` is whole or absent."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.parts = self.path / "parts"
        self.result, self.skipped = self.path / RESULT, self.path / SKIPPED

    @contextmanager
    def locked(self):
        """Exclusive use of the directory; the kernel drops the lock when the process dies."""
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"output {self.path} exists and is not a directory; -o names a directory")
        self.parts.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InputError(f"another florist embed is writing to {self.path}; wait for it to end (or stop it) and run again") from None
            yield self
        finally:
            os.close(fd)

    def remove_temporaries(self) -> None:
        for d in (self.path, self.parts):
            for p in d.glob(".*.tmp-*"):
                p.unlink(missing_ok=True)

    # -- manifest ----------------------------------------------------------------------------
    def read_manifest(self) -> dict | None:
        path = self.path / MANIFEST
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as e:
            raise InputError(f"{path} is not valid JSON ({e}); it was not written by florist embed, or was edited. Use a new output directory") from None

    def write_manifest(self, manifest: dict) -> None:
        final = self.path / MANIFEST
        tmp = temp_path(final)
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        commit(tmp, final)

    # -- parts -------------------------------------------------------------------------------
    def part_path(self, k: int) -> Path:
        return self.parts / f"part-{k:05d}.parquet"

    def done_parts(self, part_records: list[int]) -> set[int]:
        """The parts whose files exist; each is checked to be the part this plan expects."""
        done = set()
        for k, records in enumerate(part_records):
            path = self.part_path(k)
            if path.exists():
                stats = _stats(pq.read_schema(path).metadata or {})
                if stats is None or stats.part != k or stats.records != records:
                    raise InputError(f"{path} does not belong to this job's part plan; use a new output directory")
                done.add(k)
        return done

    def write_part(self, result: PartResult) -> None:
        final = self.part_path(result.stats.part)
        tmp = temp_path(final)
        meta = {_PART_KEY: json.dumps(asdict(result.stats)).encode()}
        pq.write_table(result.table.replace_schema_metadata(meta), tmp)
        commit(tmp, final)

    def read_part(self, k: int) -> tuple[pa.Table, PartStats]:
        table = pq.read_table(self.part_path(k))
        stats = _stats(table.schema.metadata or {})
        assert stats is not None
        # NOTE: Parquet names a list's child "element"; back to Arrow's "item", so a part read
        # from disk has the schema of one just computed and the result's bytes do not depend on
        # which parts an earlier run did.
        emb = table.schema.field("embedding").type
        canonical = pa.list_(emb.value_type, emb.list_size)
        return table.set_column(table.schema.get_field_index("embedding"), "embedding", table.column("embedding").cast(canonical)), stats


def _stats(meta: dict) -> PartStats | None:
    if _PART_KEY not in meta:
        return None
    d = json.loads(meta[_PART_KEY])
    d["skipped"] = [tuple(x) for x in d["skipped"]]
    return PartStats(**d)


class FinalWriter:
    """Builds embeddings.parquet and skipped.jsonl while the job runs: parts are appended in part
    order as soon as they are done (the part just written from memory, earlier runs' from disk),
    so the result is ready when the last part is. Temporary until `finish`."""

    def __init__(self, out: OutputDir, num_parts: int, unit: str, metadata: dict[str, str], done: set[int]):
        self.out, self.num_parts, self.unit = out, num_parts, unit
        self.metadata = {k.encode(): v.encode() for k, v in metadata.items()}
        self.tmp_result, self.tmp_skipped = temp_path(out.result), temp_path(out.skipped)
        self.writer: pq.ParquetWriter | None = None
        self.skipped_file = open(self.tmp_skipped, "w")
        self.done, self.next = set(done), 0
        self.totals = Totals()
        self._advance()

    def add(self, result: PartResult) -> None:
        self.done.add(result.stats.part)
        if result.stats.part == self.next:
            self._append(result.table, result.stats)
        self._advance()

    def _advance(self) -> None:
        while self.next in self.done:
            self._append(*self.out.read_part(self.next))

    def _append(self, table: pa.Table, stats: PartStats) -> None:
        t = table.select(["id", "embedding"]).replace_schema_metadata(self.metadata)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.tmp_result, t.schema)
        self.writer.write_table(t)
        for line, error in stats.skipped:
            self.skipped_file.write(json.dumps({self.unit: line, "error": error}) + "\n")
        self.totals.add(stats)
        self.next += 1

    def finish(self) -> Totals:
        if self.next != self.num_parts:
            raise RuntimeError(f"the result is missing parts from {self.next} on")
        assert self.writer is not None
        self.writer.close()
        self.skipped_file.close()
        commit(self.tmp_result, self.out.result)
        commit(self.tmp_skipped, self.out.skipped)
        return self.totals

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.skipped_file.close()
        self.tmp_result.unlink(missing_ok=True)
        self.tmp_skipped.unlink(missing_ok=True)
