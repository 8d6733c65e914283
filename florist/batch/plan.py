"""Input files for the batch job: formats and the part plan (one index pass over the file).

A file is a sequence of *records* (a line of text or JSONL, a CSV record, a Parquet row). The job
cuts it into parts of `part_rows` records; the index pass records where each part starts, so a
part can be read on its own (by a thread here, or a Ray task elsewhere) without reading what is
before it (reader.py):

    records    r0 r1 r2 r3 | r4 r5 r6 r7 | r8 r9        part_rows = 4
    PartStart  (0, 0, 1)     (4, b4, l4)   (8, b8, l8)  (first record, byte offset, line number)

Every line is a record, blank ones included, so part boundaries never depend on content.
`line` is the 1-based line number (CSV: the line a record starts on) or, for Parquet, the 0-based
row number; messages call it "line N" or "row N" to match.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from florist.text import InputError

FORMATS = ("jsonl", "csv", "parquet", "txt")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".txt": "txt", ".text": "txt"}
BOM = "\ufeff"

# NOTE: the csv module's default limit (128 KiB per field) would turn a long document into an
# error; the limit is process-wide, so it is raised once, here.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


def detect_format(path: str | Path, given: str | None = None) -> str:
    if given is not None:
        if given not in FORMATS:
            raise InputError(f"unknown input format {given!r}; choose one of {', '.join(FORMATS)}")
        return given
    fmt = _SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise InputError(f"cannot tell the format of {path} from its name; pass --format {'|'.join(FORMATS)}")
    return fmt


@dataclass(frozen=True)
class InputSpec:
    path: str
    format: str
    text_field: str = "text"
    id_field: str = "id"
    id_field_given: bool = False  # an explicit --id-field must exist; the default may be absent


@dataclass(frozen=True)
class PartStart:
    record: int
    byte: int
    line: int


@dataclass(frozen=True)
class InputPlan:
    """Where each part starts, and where ids come from ("field": the id field; "position": `line`)."""

    num_records: int
    part_rows: int
    starts: tuple[PartStart, ...]
    id_source: str
    id_type: str  # "int64" or "string"; for Parquet the column's own type, as text
    unit: str = "line"  # what `line` counts: "line" (1-based) or, for Parquet, "row" (0-based)
    columns: tuple[str, ...] = ()  # CSV header

    @property
    def num_parts(self) -> int:
        return len(self.starts)

    def part_records(self, k: int) -> int:
        return min(self.part_rows, self.num_records - k * self.part_rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["starts"] = [[s.record, s.byte, s.line] for s in self.starts]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> InputPlan:
        return cls(d["num_records"], d["part_rows"], tuple(PartStart(*s) for s in d["starts"]), d["id_source"], d["id_type"], d["unit"], tuple(d["columns"]))


def plan_input(spec: InputSpec, part_rows: int) -> InputPlan:
    """One pass over the file: count records and find where each part starts."""
    if part_rows < 1:
        raise InputError(f"part rows must be at least 1; got {part_rows}")
    path = Path(spec.path)
    if not path.is_file():
        raise InputError(f"input {spec.path} does not exist or is not a file")
    if spec.format == "parquet":
        plan = _plan_parquet(spec, part_rows)
    elif spec.format == "csv":
        plan = _plan_csv(spec, part_rows)
    else:
        plan = _plan_lines(spec, part_rows)
    if plan.num_records == 0:
        raise InputError(f"input {spec.path} holds no records; there is nothing to embed")
    return plan


def _plan_lines(spec: InputSpec, part_rows: int) -> InputPlan:
    """Text and JSONL: one record per line; boundaries found with numpy over 1 MiB chunks."""
    starts = [PartStart(0, 0, 1)]
    newlines, offset, last = 0, 0, b"\n"
    with open(spec.path, "rb") as f:
        while chunk := f.read(1 << 20):
            pos = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            ordinal = newlines + 1 + np.arange(len(pos))  # 1-based count of each newline
            for p, n in zip(pos[ordinal % part_rows == 0], ordinal[ordinal % part_rows == 0]):
                starts.append(PartStart(int(n), offset + int(p) + 1, int(n) + 1))
            newlines += len(pos)
            offset += len(chunk)
            last = chunk[-1:]
    num_records = newlines + (last != b"\n")
    starts = [s for s in starts if s.record < num_records]
    id_source, id_type = "position", "int64"
    if spec.format == "jsonl":
        id_source, id_type = _jsonl_id_kind(spec)
    return InputPlan(num_records, part_rows, tuple(starts), id_source, id_type)


def _jsonl_id_kind(spec: InputSpec) -> tuple[str, str]:
    """Ids come from the id field when the first record has it (or it was named explicitly);
    their type (integer or string) is the type of the first id seen."""
    with open(spec.path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if spec.id_field not in rec:
                if not spec.id_field_given:
                    return "position", "int64"
                continue
            value = rec[spec.id_field]
            if isinstance(value, int) and not isinstance(value, bool):
                return "field", "int64"
            if isinstance(value, str):
                return "field", "string"
            raise InputError(f"{spec.path}: the first {spec.id_field!r} is a {type(value).__name__}; ids must be integers or strings")
    return "field", "string"


def _plan_csv(spec: InputSpec, part_rows: int) -> InputPlan:
    with open(spec.path, "rb") as f:
        lines = ByteLines(f, 0, 1)
        reader = csv.reader(lines)
        try:
            header = next(reader)
        except StopIteration:
            raise InputError(f"input {spec.path} is empty; a CSV file needs a header line") from None
        header = [header[0].removeprefix(BOM), *header[1:]] if header else header
        if spec.text_field not in header:
            raise InputError(f"{spec.path} has no {spec.text_field!r} column (columns: {', '.join(header)}); pass --text-field")
        if spec.id_field_given and spec.id_field not in header:
            raise InputError(f"{spec.path} has no {spec.id_field!r} column (columns: {', '.join(header)}); pass another --id-field or none")
        starts, n = [], 0
        while True:
            if n % part_rows == 0:
                start = PartStart(n, lines.offset, lines.line)
            try:
                next(reader)
            except StopIteration:
                break
            except csv.Error:
                pass  # a malformed record is still one record; reading the part reports it
            if n % part_rows == 0:
                starts.append(start)
            n += 1
    id_source = "field" if spec.id_field in header else "position"
    return InputPlan(n, part_rows, tuple(starts), id_source, "string" if id_source == "field" else "int64", "line", tuple(header))


def _plan_parquet(spec: InputSpec, part_rows: int) -> InputPlan:
    import pyarrow.parquet as pq

    schema = pq.read_schema(spec.path)
    if spec.text_field not in schema.names:
        raise InputError(f"{spec.path} has no {spec.text_field!r} column (columns: {', '.join(schema.names)}); pass --text-field")
    text_type = schema.field(spec.text_field).type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise InputError(f"{spec.path}: column {spec.text_field!r} is {text_type}, not a string column; pass --text-field")
    if spec.id_field_given and spec.id_field not in schema.names:
        raise InputError(f"{spec.path} has no {spec.id_field!r} column (columns: {', '.join(schema.names)}); pass another --id-field or none")
    n = pq.ParquetFile(spec.path).metadata.num_rows
    starts = tuple(PartStart(k, 0, k) for k in range(0, n, part_rows))  # rows, not bytes
    if spec.id_field in schema.names:
        return InputPlan(n, part_rows, starts, "field", str(schema.field(spec.id_field).type), "row")
    return InputPlan(n, part_rows, starts, "position", "int64", "row")


class ByteLines:
    """Lines of a binary file as text (invalid UTF-8 kept as surrogates), counting bytes and lines,
    for the csv module: after it yields a record, `offset` is where the next record starts."""

    def __init__(self, f, offset: int, line: int):
        self.f, self.offset, self.line = f, offset, line  # `line`: the number of the next line

    def __iter__(self):
        for raw in self.f:
            self.offset += len(raw)
            self.line += 1
            yield raw.decode("utf-8", "surrogateescape")
