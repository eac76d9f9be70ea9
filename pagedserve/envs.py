"""The environment switches: every `PAGEDSERVE_*` variable that code reads outside the command
line's flags, in one typed registry (name, type, default, a line of doc).

`get()` parses `os.environ` once per process, on first use; a bad value raises `EnvError`
naming the variable and what it accepts. A child process reads its own environment when it
first asks, so a switch set in a worker's environment holds there from its start. Tests that
change `os.environ` in-process call `reload()`.

The command line's flags read `PAGEDSERVE_<FLAG>` themselves (pagedserve/cli/flags.py); the
switches here have no flag. docs/architecture.md, "Environment switches", lists them (`table()`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PREFIX = "PAGEDSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class EnvError(ValueError):
    """A `PAGEDSERVE_*` variable holds a value its switch does not accept."""


@dataclass(frozen=True)
class Kind:
    """How a switch's text becomes its value; `accepts` says in words what it takes."""

    accepts: str
    parse: Callable[[str], Any]


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _choice(*values: str, fold: bool = False) -> Kind:
    def parse(text: str) -> str:
        key = text.lower() if fold else text
        if key not in values:
            raise ValueError(text)
        return key

    return Kind(", ".join(values[:-1]) + " or " + values[-1], parse)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


FLAG = Kind("0 or 1", _flag)
POSITIVE_INT = Kind("an integer >= 1", _positive_int)
PATH = Kind("a directory", Path)
TEXT = Kind("any text", str)


def _switch(kind: Kind, default: Any, doc: str) -> Any:
    return field(default=default, metadata={"kind": kind, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """The switches' values (field `x` is `PAGEDSERVE_<X>`; None: unset, the code decides)."""

    cpu_team: bool = _switch(
        FLAG, True, "a CPU worker runs its projections on the stall-free CPU team where it fits"
    )
    cpu_team_amx: str | None = _switch(
        _choice("0", "1", "model"),
        None,
        "the team's bf16 products: 1 on AMX tiles, 0 on oneDNN's, model on a software model "
        "of the tiles (tests); unset: the tiles where the CPU has AMX",
    )
    cpu_decode_kernel: bool = _switch(FLAG, True, "decode attention in the C kernel (0: torch)")
    cpu_prefill_kernel: bool | None = _switch(
        FLAG, None, "prompt attention in the C kernel (0: SDPA); unset: where the CPU has AVX-512"
    )
    cpu_fused_ops: bool = _switch(
        FLAG, True, "fused C norm, rotary and activation ops on CPU (0: torch's)"
    )
    onednn_linear: bool = _switch(
        FLAG, True, "CPU projections prepacked for oneDNN or the team (0: F.linear)"
    )
    bf16_widen: bool = _switch(
        FLAG, False, "bf16 projections multiply in float32 even where the CPU has bf16 products"
    )
    bf16_row_align: int | None = _switch(
        POSITIVE_INT, None, "rows a bf16 product is padded to; unset: 16 with AMX, else 1"
    )
    cache_dir: Path | None = _switch(
        PATH, None, "built kernels, models and gRPC tokens; unset: ~/.cache/pagedserve"
    )
    log_format: str | None = _switch(
        _choice("auto", "json", "console"),
        None,
        "a component's log lines when it has no --log-format; unset: auto",
    )
    log_level: str = _switch(_choice(*LOG_LEVELS, fold=True), "info", "the lowest level logged")
    api_key: str | None = _switch(
        TEXT, None, "the key `pagedserve bench` sends and `up`'s curl hint reads"
    )

    @property
    def cache_root(self) -> Path:
        """`cache_dir`, or its default."""
        return self.cache_dir or Path.home() / ".cache" / "pagedserve"

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> Settings:
        """The switches in `env`; an unset or empty variable keeps its default."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = PREFIX + f.name.upper()
            text = env.get(name)
            if not text:
                continue
            kind: Kind = f.metadata["kind"]
            try:
                values[f.name] = kind.parse(text)
            except ValueError:
                raise EnvError(f"{name}={text!r}: it accepts {kind.accepts}") from None
        return cls(**values)


@dataclass(frozen=True)
class Entry:
    """One switch of the registry, as documented."""

    name: str
    accepts: str
    default: str
    doc: str


def registry() -> list[Entry]:
    """Every switch, in declaration order."""
    return [
        Entry(
            PREFIX + f.name.upper(),
            f.metadata["kind"].accepts,
            _shown(f.default),
            f.metadata["doc"],
        )
        for f in fields(Settings)
    ]


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    return str(int(default)) if isinstance(default, bool) else str(default)


def table() -> str:
    """The registry as a Markdown table (docs/architecture.md)."""
    rows = ["| Variable | Accepts | Default | What it does |", "|---|---|---|---|"]
    rows += [f"| `{e.name}` | {e.accepts} | {e.default} | {e.doc} |" for e in registry()]
    return "\n".join(rows)


_settings: Settings | None = None


def get() -> Settings:
    """This process's switches, parsed from its environment on the first call."""
    global _settings
    if _settings is None:
        _settings = Settings.from_environ(os.environ)
    return _settings


def reload(env: Mapping[str, str] | None = None) -> Settings:
    """Parses the switches again, from `env` (default: `os.environ`): for tests that change
    the environment in-process."""
    global _settings
    _settings = Settings.from_environ(os.environ if env is None else env)
    return _settings
