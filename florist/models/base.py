"""What every model family declares: how checkpoint tensor names map onto its parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

ShardId = Union[str, int, None]
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class WeightMap:
    """Declared mapping from checkpoint names to (parameter name, shard id).

    A checkpoint name is first stripped of one of `strip_prefixes`; names starting with an
    `ignore` prefix are skipped on purpose (buffers, heads the task does not use). `renames` maps a
    prefix (with `{i}` for a layer index) to a parameter prefix and the shard of a fused parameter
    it fills; any other name maps to `default_prefix + name`. `also` lists extra targets a tensor
    feeds (tied weights). Suffixes in `suffix_renames` are rewritten (old `gamma`/`beta` names).
    """

    strip_prefixes: tuple[str, ...] = ()
    renames: dict[str, tuple[str, ShardId]] = field(default_factory=dict)
    ignore: tuple[str, ...] = ()
    default_prefix: str = "model."
    also: dict[str, tuple[tuple[str, ShardId], ...]] = field(default_factory=dict)
    suffix_renames: dict[str, str] = field(default_factory=dict)

    def targets(self, name: str) -> list[tuple[str, ShardId]]:
        for prefix in self.strip_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if self.ignore and name.startswith(self.ignore):
            return []
        for old, new in self.suffix_renames.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        extra = list(self.also.get(name, ()))
        m = _LAYER_INDEX.search(name)
        generic = name if m is None else name[: m.start()] + ".{i}." + name[m.end() :]
        for pattern, (target, shard) in self.renames.items():
            if generic.startswith(pattern):
                rest = generic[len(pattern) :]
                return [(target.format(i=m.group(1) if m else "") + rest, shard)] + extra
        return [(self.default_prefix + name, None)] + extra
