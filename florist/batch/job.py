"""One batch embedding job, start to finish: check or start the output, run the parts not yet
done (here, or on Ray), assemble the result, report.

    plan (plan.py) ─▶ parts not on disk ─▶ runner ─▶ PartSink ─▶ part file, result, progress
                                              local.py: reader+tokenizer thread │ device │ writer thread
                                              ray_job.py: read+tokenize tasks │ engine actors │ driver

The manifest pins what the output depends on (the input file's identity and the options that
change the vectors); a second run with a different input or different options is refused, so a
resumed job never mixes two kinds of rows. `--on-error`, `--batch-tokens`, `--device` and `--ray`
change how a job runs, not what it writes, and may differ between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from florist.batch.embedder import OutputOptions, Tokenize
from florist.batch.plan import InputPlan, InputSpec, detect_format, plan_input
from florist.batch.progress import Progress
from florist.batch.store import FinalWriter, OutputDir, PartResult, Totals
from florist.engine.output import check_output_options
from florist.text import InputError

MANIFEST_VERSION = 1
_LOGGED_SKIPS = 20  # skipped records named in the log; all of them are in skipped.jsonl


@dataclass(frozen=True)
class JobConfig:
    input: str
    output: str
    model: str | None = None
    format: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    id_field_given: bool = False
    prompt_name: str | None = None
    dimensions: int | None = None
    encoding: str = "float"
    truncate: bool = False
    on_error: str = "fail"
    part_rows: int = 10_000
    batch_tokens: int = 16_384
    device: str | None = None
    dtype: str | None = None
    ray: bool = False
    address: str | None = None
    num_replicas: int | None = None


@dataclass
class Summary:
    records: int
    rows: int
    skipped: int
    blank: int
    tokens: int
    run_rows: int  # embedded by this run (the rest were done by an earlier one)
    run_tokens: int
    run_seconds: float
    result: str
    skipped_file: str

    @property
    def embeddings_per_s(self) -> float:
        return self.run_rows / self.run_seconds if self.run_seconds > 0 else 0.0

    def lines(self) -> list[str]:
        out = [f"{self.rows} rows embedded, {self.skipped} skipped, {self.blank} blank of {self.records} records -> {self.result}"]
        if self.skipped:
            out.append(f"skipped records and why: {self.skipped_file}")
        earlier = self.rows - self.run_rows
        out.append(f"this run: {self.run_rows} rows, {self.run_tokens} tokens in {self.run_seconds:.1f} s: {self.embeddings_per_s:.1f} embeddings/s"
                   + (f" ({earlier} rows were embedded by an earlier run)" if earlier else ""))
        return out


class MalformedRecord(InputError):
    """A malformed record under --on-error fail (the parts before it are saved)."""


def input_identity(path: str) -> dict:
    """Size, modification time and a hash of the first and last MiB: enough to notice that the
    file a job was started on was replaced or changed, without reading it all."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
        h.update(f.read(1 << 20))
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_head_tail": h.hexdigest()}


def job_options(cfg: JobConfig, spec: InputSpec, md, prompt: str, dtype: str) -> dict:
    """Everything the written vectors depend on; compared when a job is resumed."""
    fielded = spec.format != "txt"
    return {
        "model": md.name, "model_path": str(md.path), "dtype": dtype, "format": spec.format,
        "text_field": spec.text_field if fielded else None, "id_field": spec.id_field if fielded else None,
        "prompt": prompt, "dimensions": cfg.dimensions, "encoding": cfg.encoding, "normalize": md.pipeline.normalize,
        "truncate": cfg.truncate, "part_rows": cfg.part_rows,
    }


def check_resume(out: OutputDir, manifest: dict, identity: dict, options: dict) -> None:
    if manifest.get("version") != MANIFEST_VERSION:
        raise InputError(f"{out.path} was written by another version of florist embed (manifest version {manifest.get('version')}); use a new output directory")
    again = f"Use a new output directory (or delete {out.path}) to start over"
    old = manifest["input"]
    changed = [k for k in ("path", "size", "mtime_ns", "sha256_head_tail") if old.get(k) != identity[k]]
    if changed:
        what = ", ".join(f"{k} {old.get(k)!r} then, {identity[k]!r} now" for k in changed)
        raise InputError(f"{out.path} was started on another input, or the input changed ({what}); resuming would mix two inputs. {again}")
    diffs = [f"{k} {manifest['options'].get(k)!r} then, {v!r} now" for k, v in options.items() if manifest["options"].get(k) != v]
    if diffs:
        raise InputError(f"{out.path} holds a job with other settings ({'; '.join(diffs)}). Run the same command as before to resume it. {again}")


class PartSink:
    """Where finished parts go: checked against --on-error, written, appended, counted, logged."""

    def __init__(self, out: OutputDir, final: FinalWriter, progress: Progress, on_error: str, unit: str):
        self.out, self.final, self.progress = out, final, progress
        self.on_error, self.unit = on_error, unit
        self.logged = 0

    def check(self, rows: pa.Table) -> None:
        """Under --on-error fail, refuse a part with a malformed record before it is embedded."""
        if self.on_error != "fail":
            return
        errors = rows.filter(pc.is_valid(rows.column("error")))
        if errors.num_rows:
            line, error = errors.column("line")[0].as_py(), errors.column("error")[0].as_py()
            raise MalformedRecord(
                f"{self.unit} {line}: {error}. Fix the input, or pass --on-error skip to skip malformed records "
                f"(they are counted and listed in {self.out.skipped}); the parts before it are saved, so the same command resumes"
            )

    def write(self, result: PartResult) -> None:
        self.out.write_part(result)
        self.final.add(result)
        s = result.stats
        for line, error in s.skipped:
            if self.logged < _LOGGED_SKIPS:
                self.progress.log(f"skipped {self.unit} {line}: {error}")
            elif self.logged == _LOGGED_SKIPS:
                self.progress.log(f"more skipped records will be listed in {self.out.skipped}")
            self.logged += 1
        self.progress.update(s.records, s.rows, s.tokens)


def run_job(cfg: JobConfig, *, engine=None, progress: str = "auto", log=print) -> Summary:
    """Run (or resume, or just report) the job. `engine`: an already loaded one (local path only);
    `progress`: "auto" (a bar on a terminal, else log lines), "bar", "log" or "off"; `log`: where
    messages go (resuming, skipped records)."""
    if cfg.on_error not in ("skip", "fail"):
        raise InputError(f"--on-error must be skip or fail, got {cfg.on_error!r}")
    for name, value in (("--part-rows", cfg.part_rows), ("--batch-tokens", cfg.batch_tokens), ("--num-replicas", cfg.num_replicas)):
        if value is not None and value < 1:  # checked before a model loads or a Ray cluster is joined
            raise InputError(f"{name} must be at least 1; got {value}")
    spec = InputSpec(str(Path(cfg.input).resolve()), detect_format(cfg.input, cfg.format), cfg.text_field, cfg.id_field, cfg.id_field_given)
    if not Path(spec.path).is_file():
        raise InputError(f"input {cfg.input} does not exist or is not a file")
    out = OutputDir(cfg.output)
    with out.locked():
        out.remove_temporaries()
        if cfg.ray:
            from florist.batch.ray_job import RayRunner

            runner = RayRunner(cfg, spec)
        else:
            from florist.batch.local import LocalRunner

            runner = LocalRunner(cfg, spec, engine)
        try:
            return _run(cfg, spec, out, runner, progress, log)
        finally:
            runner.close()


def _run(cfg: JobConfig, spec: InputSpec, out: OutputDir, runner, progress_mode: str, log) -> Summary:
    md, text = runner.model_dir, runner.text
    if md.pipeline.task != "embed":
        raise InputError(f"florist embed needs an embedding model; {md.name} is loaded for {md.pipeline.task}")
    check_output_options(runner.model_dim, cfg.dimensions, cfg.encoding, md.pipeline.native_quantization)
    prompt = text.resolve_prompt(cfg.prompt_name, None)
    options = job_options(cfg, spec, md, prompt, runner.dtype)
    identity = input_identity(spec.path)
    manifest = out.read_manifest()
    if manifest is not None:
        check_resume(out, manifest, identity, options)
        plan = InputPlan.from_dict(manifest["plan"])
        if manifest.get("state") == "complete" and out.result.exists() and out.skipped.exists():
            log(f"florist embed: {out.path} is already complete")
            return Summary(**{**manifest["summary"], "run_rows": 0, "run_tokens": 0, "run_seconds": 0.0})
    else:
        plan = plan_input(spec, cfg.part_rows)
        manifest = {"version": MANIFEST_VERSION, "state": "running", "input": identity, "options": options, "plan": plan.to_dict()}
        out.write_manifest(manifest)
    part_records = [plan.part_records(k) for k in range(plan.num_parts)]
    done = out.done_parts(part_records)
    pending = [k for k in range(plan.num_parts) if k not in done]
    if done:
        log(f"florist embed: resuming {out.path}: {len(done)} of {plan.num_parts} parts are done")
    output = OutputOptions(cfg.dimensions, cfg.encoding, md.pipeline.normalize)
    meta = {"florist.embed": _result_metadata(options, runner.model_dim, output)}
    final = FinalWriter(out, plan.num_parts, plan.unit, meta, done)
    progress = Progress(plan.num_records, sum(part_records[k] for k in done), mode=progress_mode, log=log)
    sink = PartSink(out, final, progress, cfg.on_error, plan.unit)
    start = time.perf_counter()
    try:
        if pending:
            runner.run(plan, pending, Tokenize(text, prompt, cfg.truncate), output, sink)
        totals = final.finish()
    except BaseException:
        final.abort()
        raise
    finally:
        progress.close()
    summary = _summary(plan, totals, progress, time.perf_counter() - start, out)
    out.write_manifest({**manifest, "state": "complete", "summary": asdict(summary)})
    return summary


def _result_metadata(options: dict, model_dim: int, output: OutputOptions) -> str:
    return json.dumps({**{k: options[k] for k in ("model", "dtype", "prompt", "dimensions", "encoding", "normalize", "truncate")}, "width": output.width(model_dim)})


def _summary(plan: InputPlan, totals: Totals, progress: Progress, seconds: float, out: OutputDir) -> Summary:
    return Summary(records=plan.num_records, rows=totals.rows, skipped=totals.skipped, blank=totals.blank, tokens=totals.tokens,
                   run_rows=progress.rows, run_tokens=progress.tokens, run_seconds=seconds, result=str(out.result), skipped_file=str(out.skipped))
