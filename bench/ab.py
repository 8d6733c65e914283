"""Side-by-side runs of one bench command under settings of an environment variable (or of extra
arguments), interleaved.

On the H200 a bench figure moves by ~5 % between processes and between machines, often more
than the change under test. Comparing two settings means running each several times, on one
machine, alternating them, and reading the differences round by round. This script does that:

    python bench/ab.py --env FLORIST_PDL=off,wait --rounds 3 -- \\
        python bench/engine.py --only breakdown,minilm-breakdown --no-baseline

Round r runs the command once per setting (in the given order on even rounds, reversed on odd
ones, so neither setting always runs first), each a fresh process with VAR=setting and
`--json FILE` appended; the command must write bench/report.py rows there (bench/engine.py,
generate.py and serve.py do; serve.py's rows are florist's figures of every cell, so
`-- python bench/serve.py --scenarios 4 --florist-only` compares a serving setting). With `--args
A --args B ...` in place of `--env`, a setting is extra arguments put after the command (before
`--json FILE`), e.g. `--args "" --args "--serve-flags=--in-process"`; an empty one adds
nothing. `--env` given more than once sets several variables together, setting i taking each
variable's i-th value (each `--env` lists as many), e.g. `--env A=1,1,2,2 --env B=x,y,x,y` runs
the four combinations. It then prints, for every measured value (a row's
florist figure and its numeric extras, e.g. the breakdown's `gpu_ms`), each setting's figure
per round and their median, and for every setting after the first, the median of its
round-by-round difference to the first and in how many rounds it was ahead (lower is ahead
for times, higher for rates: units ending in "/s"). `--out DIR` keeps every run's rows and a
summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Keys of a report row that are not measured values.
_NOT_VALUES = {"scenario", "metric", "florist", "transformers", "unit", "speedup"}


def parse_env(spec: str) -> tuple[str, list[str]]:
    name, sep, values = spec.partition("=")
    settings = values.split(",")
    if not sep or not name or len(settings) < 2 or any(not v for v in settings):
        raise argparse.ArgumentTypeError(f"--env takes NAME=VALUE1,VALUE2[,...] (two settings at least), not {spec!r}")
    return name, settings


def values_of(rows: list[dict]) -> dict[tuple[str, str], tuple[float, bool]]:
    """{(row, value name): (value, higher is better)} for one run's report rows."""
    out: dict[tuple[str, str], tuple[float, bool]] = {}
    for r in rows:
        higher = str(r.get("unit", "")).endswith("/s")
        label = f"{r['scenario']} [{r['metric']}]"
        if isinstance(r.get("florist"), (int, float)):
            out[(label, "florist")] = (float(r["florist"]), higher)
        for k, v in r.items():
            if k in _NOT_VALUES or k.startswith("baseline"):
                continue
            if isinstance(v, dict):  # percentiles: {"p50": .., "p99": .., "n": ..}
                for k2, v2 in v.items():
                    if k2 != "n" and _is_number(v2):
                        out[(label, f"{k}.{k2}")] = (float(v2), higher)
            elif _is_number(v):
                out[(label, k)] = (float(v), k.endswith("_per_s") or (higher and not k.endswith("_ms")))
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def file_safe(setting: str) -> str:
    """A setting as part of a file name: letters, digits, '.', '_' and '-' only (the device
    machines hand back no file whose name holds anything else, '=' included)."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in setting)


ARGS = "args"  # the name under which --args settings are shown and filed
ENVS = "env"  # ... and settings of several variables at once (each "A=1 B=x")


def label(name: str, setting: str) -> str:
    """How a setting is printed: NAME=VALUE, args="..." for extra arguments, or the variables'
    NAME=VALUE pairs as they are."""
    if name == ENVS:
        return setting
    return f'{name}="{setting}"' if name == ARGS else f"{name}={setting}"


def zip_envs(specs: list[tuple[str, list[str]]]) -> list[str]:
    """Several `--env` specs -> one setting per position, each "A=1 B=x" (values quoted as a
    shell would need). Each spec must list as many values, and no variable may come twice."""
    names = [name for name, _ in specs]
    if len(set(names)) < len(names):
        raise ValueError(f"a variable given in two --env: {names}")
    if len({len(values) for _, values in specs}) != 1:
        raise ValueError("each --env must list as many settings (setting i takes each variable's i-th value)")
    settings = [" ".join(f"{name}={shlex.quote(v)}" for name, v in zip(names, values)) for values in zip(*(v for _, v in specs))]
    if len(set(settings)) < len(settings):
        raise ValueError("two settings set every variable alike")
    return settings


def environment(name: str, setting: str) -> tuple[dict[str, str], list[str]]:
    """The process environment and extra arguments a setting runs with."""
    if name == ARGS:
        return {**os.environ}, shlex.split(setting)
    if name == ENVS:
        return {**os.environ, **dict(pair.split("=", 1) for pair in shlex.split(setting))}, []
    return {**os.environ, name: setting}, []


def run_rounds(command: list[str], name: str, settings: list[str], rounds: int, timeout: float, out: Path | None) -> list[dict]:
    """-> one entry per run: {"round", "setting", "seconds", "rows"} (rows None if the run failed).
    `name` is the environment variable the settings are given to, ARGS (they are arguments) or
    ENVS (each sets several variables: `zip_envs`)."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for setting in settings if r % 2 == 0 else settings[::-1]:
                rows_file = (out or Path(tmp)) / f"round{r}-{name}-{file_safe(setting) or 'none'}.json"
                env, extra = environment(name, setting)
                started = time.perf_counter()
                try:
                    proc = subprocess.run([*command, *extra, "--json", str(rows_file)], env=env, capture_output=True, text=True, timeout=timeout)
                    failed = None if proc.returncode == 0 and rows_file.is_file() else f"exit {proc.returncode}"
                    output = f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
                except subprocess.TimeoutExpired:
                    failed, output = f"stopped after --timeout {timeout:g} s", ""
                seconds = time.perf_counter() - started
                rows = None if failed else json.loads(rows_file.read_text())
                if rows is None:
                    print(f"round {r} {label(name, setting)}: FAILED ({failed})\n{output}", flush=True)
                else:
                    print(f"round {r} {label(name, setting)}: {len(rows)} rows in {seconds:.1f} s", flush=True)
                runs.append({"round": r, "setting": setting, "seconds": seconds, "rows": rows})
    return runs


def compare(runs: list[dict], settings: list[str]) -> list[dict]:
    """One entry per measured value: each setting's figures by round, their median, and for the
    settings after the first the median round-by-round difference to it and the rounds ahead."""
    by_round: dict[tuple[int, str], dict] = {(run["round"], run["setting"]): values_of(run["rows"]) for run in runs if run["rows"] is not None}
    keys: list[tuple[str, str]] = []
    for vals in by_round.values():
        keys += [k for k in vals if k not in keys]
    rounds = sorted({r for r, _ in by_round})
    table = []
    for key in keys:
        entry = {"row": key[0], "value": key[1], "settings": {}}
        higher = next(vals[key][1] for vals in by_round.values() if key in vals)
        for s in settings:
            figures = [by_round[(r, s)][key][0] for r in rounds if key in by_round.get((r, s), {})]
            entry["settings"][s] = {"figures": figures, "median": statistics.median(figures) if figures else None}
        first = settings[0]
        for s in settings[1:]:
            diffs = [by_round[(r, s)][key][0] - by_round[(r, first)][key][0] for r in rounds
                     if key in by_round.get((r, s), {}) and key in by_round.get((r, first), {})]
            ahead = sum(1 for d in diffs if (d > 0 if higher else d < 0))
            entry["settings"][s].update({"median_diff": statistics.median(diffs) if diffs else None, "ahead": ahead, "pairs": len(diffs)})
        table.append(entry)
    return table


def print_table(table: list[dict], name: str, settings: list[str]) -> None:
    first = settings[0]
    print(f"\n== {name}: {' / '.join(settings)}; figures by round (median); vs {first}: median difference, rounds ahead")
    for e in table:
        print(f"{e['row']} {e['value']}")
        for s in settings:
            d = e["settings"][s]
            figs = " / ".join(f"{f:.4g}" for f in d["figures"])
            med = f"({d['median']:.4g})" if d["median"] is not None else "(-)"
            vs = ""
            if s != first and d.get("median_diff") is not None:
                vs = f"   {d['median_diff']:+.4g}, ahead in {d['ahead']} of {d['pairs']}"
            print(f"    {label(name, s):20s} {figs} {med}{vs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example:\n  python bench/ab.py --env FLORIST_PDL=off,wait --rounds 3 -- "
                                       "python bench/engine.py --only breakdown --no-baseline")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--env", type=parse_env, action="append", metavar="NAME=V1,V2[,...]",
                      help="the variable and its settings (the first is the reference); more than once: several variables set "
                           "together, setting i taking each one's i-th value")
    what.add_argument("--args", action="append", metavar="ARGS",
                      help="a setting made of extra arguments for the command (shell words; \"\" for none); give two or more, "
                           "the first is the reference")
    p.add_argument("--rounds", type=int, default=3, help="runs of each setting, interleaved (default 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is stopped (default 600)")
    p.add_argument("--out", type=Path, default=None, help="directory for every run's rows and summary.json")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bench command (it gets --json FILE appended)")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the bench command after --")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.env and len(args.env) > 1:
        try:
            name, settings = ENVS, zip_envs(args.env)
        except ValueError as e:
            p.error(str(e))
    elif args.env:
        name, settings = args.env[0]
    else:
        name, settings = ARGS, args.args
        if len(settings) < 2 or len(set(settings)) < len(settings):
            p.error("--args takes two settings at least, each given once")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    runs = run_rounds(command, name, settings, args.rounds, args.timeout, args.out)
    table = compare(runs, settings)
    print_table(table, name, settings)
    if args.out:
        summary = {"command": command, "env": " ".join(n for n, _ in args.env) if name == ENVS else name, "settings": settings, "rounds": args.rounds,
                   "runs": [{k: v for k, v in run.items() if k != "rows"} | {"ok": run["rows"] is not None} for run in runs], "table": table}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if any(run["rows"] is None for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
