"""Reading one part of an input file (plan.py says where it starts) as a table of records.

One row per record, in file order:

    part int32 | line int64 | id | text string | error string
    text set, error null  -> a document
    error set             -> a malformed record ("invalid JSON (...)", "text is empty", ...)
    both null             -> a blank line: not a document; counted, not embedded

Invalid UTF-8 is decoded to lone surrogates and reported per record, never for the whole file.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pyarrow as pa

from florist.batch.plan import BOM, ByteLines, InputPlan, InputSpec, PartStart

_ID_TYPES = {"int64": pa.int64(), "string": pa.string()}


def read_part(spec: InputSpec, plan: InputPlan, k: int) -> pa.Table:
    """Part k as a table of its records (see the module docstring), in file order."""
    start, count = plan.starts[k], plan.part_records(k)
    if spec.format == "parquet":
        return _read_parquet(spec, plan, k, start, count)
    rows = _Rows(k)
    with open(spec.path, "rb") as f:
        f.seek(start.byte)
        if spec.format == "csv":
            _read_csv(spec, plan, f, start, count, rows)
        else:
            parse = _parse_jsonl if spec.format == "jsonl" else _parse_txt
            for i in range(count):
                line_no = start.line + i
                text = f.readline().decode("utf-8", "surrogateescape").rstrip("\r\n")
                if line_no == 1:
                    text = text.removeprefix(BOM)
                parse(spec, plan, rows, line_no, text)
    return rows.table(_ID_TYPES[plan.id_type])


class _Rows:
    def __init__(self, part: int):
        self.part = part
        self.lines: list[int] = []
        self.ids: list = []
        self.texts: list[str | None] = []
        self.errors: list[str | None] = []

    def add(self, line: int, id_, text: str | None, error: str | None = None) -> None:
        if text is not None and error is None:
            error = _text_problem(text)
            if error is None and isinstance(id_, str) and not _is_utf8(id_):
                error = "id is not valid UTF-8"
        self.lines.append(line)
        self.ids.append(None if error else id_)
        self.texts.append(None if error else text)
        self.errors.append(error)

    def table(self, id_type: pa.DataType) -> pa.Table:
        return pa.table({
            "part": pa.array([self.part] * len(self.lines), pa.int32()),
            "line": pa.array(self.lines, pa.int64()),
            "id": pa.array(self.ids, id_type),
            "text": pa.array(self.texts, pa.string()),
            "error": pa.array(self.errors, pa.string()),
        })


def _text_problem(text: str) -> str | None:
    if not text:
        return "text is empty"
    return None if _is_utf8(text) else "text is not valid UTF-8"


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")  # invalid input bytes were decoded to lone surrogates
    except UnicodeEncodeError:
        return False
    return True


def _parse_txt(spec, plan, rows: _Rows, line: int, text: str) -> None:
    rows.add(line, line, text if text.strip() else None)


def _parse_jsonl(spec: InputSpec, plan: InputPlan, rows: _Rows, line: int, text: str) -> None:
    if not text.strip():
        rows.add(line, None, None)
        return
    try:
        rec = json.loads(text)
    except ValueError as e:
        rows.add(line, None, None, f"invalid JSON ({e})")
        return
    if not isinstance(rec, dict):
        rows.add(line, None, None, f"{_json_kind(rec)}, not a JSON object")
        return
    value = rec.get(spec.text_field)
    if not isinstance(value, str):
        problem = f"no {spec.text_field!r} field" if spec.text_field not in rec else f"{spec.text_field!r} is {_json_kind(value)}, not a string"
        rows.add(line, None, None, problem)
        return
    id_ = line
    if plan.id_source == "field":
        id_ = rec.get(spec.id_field)
        want = int if plan.id_type == "int64" else str
        if spec.id_field not in rec:
            rows.add(line, None, None, f"no {spec.id_field!r} field")
            return
        if not isinstance(id_, want) or isinstance(id_, bool):
            kind = "integers" if want is int else "strings"
            rows.add(line, None, None, f"{spec.id_field!r} is {_json_kind(id_)}; the ids in this file are {kind}")
            return
    rows.add(line, id_, value)


def _json_kind(value) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _read_csv(spec: InputSpec, plan: InputPlan, f, start: PartStart, count: int, rows: _Rows) -> None:
    lines = ByteLines(f, start.byte, start.line)
    reader = csv.reader(lines)
    header = plan.columns
    text_col = header.index(spec.text_field)
    id_col = header.index(spec.id_field) if plan.id_source == "field" else -1
    for _ in range(count):
        line = lines.line
        try:
            rec = next(reader)
        except csv.Error as e:
            rows.add(line, None, None, f"malformed CSV ({e})")
            continue
        if not rec:
            rows.add(line, None, None)
        elif len(rec) != len(header):
            rows.add(line, None, None, f"{len(rec)} field{'s' * (len(rec) != 1)}; the header has {len(header)}")
        else:
            rows.add(line, rec[id_col] if id_col >= 0 else line, rec[text_col])


def _read_parquet(spec: InputSpec, plan: InputPlan, k: int, start: PartStart, count: int) -> pa.Table:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(spec.path)
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    group_starts = np.concatenate([[0], np.cumsum(sizes)])
    stop = start.record + count
    groups = [g for g in range(len(sizes)) if group_starts[g] < stop and group_starts[g + 1] > start.record]
    columns = [spec.text_field] + ([spec.id_field] if plan.id_source == "field" else [])
    t = pf.read_row_groups(groups, columns=columns).slice(start.record - int(group_starts[groups[0]]), count)
    lines = pa.array(np.arange(start.record, stop, dtype=np.int64))
    text = t.column(spec.text_field).cast(pa.string())
    none = pa.scalar(None, pa.string())
    error = pc.if_else(pc.is_null(text), "text is null", pc.if_else(pc.equal(pc.utf8_length(text), 0), "text is empty", none))
    ids = lines
    if plan.id_source == "field":
        ids = t.column(spec.id_field)
        error = pc.if_else(pc.and_(pc.is_null(error), pc.is_null(ids)), f"{spec.id_field!r} is null", error)
    ok = pc.is_null(error)
    return pa.table({
        "part": pa.array(np.full(count, k, dtype=np.int32)),
        "line": lines,
        "id": pc.if_else(ok, ids, pa.scalar(None, ids.type)),
        "text": pc.if_else(ok, text, none),
        "error": error,
    })
