"""The environment switches (`pagedserve/envs.py`): parsed from a mapping, a bad value fails
naming the variable, and product code reads no PAGEDSERVE_* variable around the registry."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pagedserve import envs
from pagedserve.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("control_plane", "gpu_worker", "kernels", "gateway", "pagedserve", "simulator")
# The registry itself, and the command line's per-flag fallback (PAGEDSERVE_<FLAG>).
READERS = {Path("pagedserve/envs.py"), Path("pagedserve/cli/flags.py")}
NAME = re.compile(r"PAGEDSERVE_[A-Z0-9_]*")
DIRECT_READ = re.compile(r"""(environ\.get|getenv|environ\[)\(?\s*["']PAGEDSERVE_""")


def sources() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name)


def flag_variables() -> set[str]:
    """PAGEDSERVE_<FLAG> for every flag of every subcommand."""
    names: set[str] = set()
    todo = [build_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
            for flag in action.option_strings:
                if flag.startswith("--"):
                    names.add("PAGEDSERVE_" + flag[2:].replace("-", "_").upper())
    return names


def test_defaults_where_unset_or_empty() -> None:
    settings = envs.Settings.from_environ({"PAGEDSERVE_BF16_ROW_ALIGN": ""})
    assert settings == envs.Settings()
    assert settings.cpu_team and settings.bf16_row_align is None
    assert settings.cache_root == Path.home() / ".cache" / "pagedserve"


def test_values_parse_to_their_types(tmp_path: Path) -> None:
    settings = envs.Settings.from_environ(
        {
            "PAGEDSERVE_CPU_TEAM": "0",
            "PAGEDSERVE_CPU_TEAM_AMX": "model",
            "PAGEDSERVE_CPU_PREFILL_KERNEL": "1",
            "PAGEDSERVE_BF16_ROW_ALIGN": "16",
            "PAGEDSERVE_CACHE_DIR": str(tmp_path),
            "PAGEDSERVE_LOG_LEVEL": "DEBUG",
        }
    )
    assert settings.cpu_team is False and settings.cpu_team_amx == "model"
    assert settings.cpu_prefill_kernel is True and settings.bf16_row_align == 16
    assert settings.cache_root == tmp_path and settings.log_level == "debug"


@pytest.mark.parametrize(
    ("name", "value", "accepts"),
    [
        ("PAGEDSERVE_CPU_TEAM", "yes", "0 or 1"),
        ("PAGEDSERVE_CPU_TEAM_AMX", "on", "0, 1 or model"),
        ("PAGEDSERVE_BF16_ROW_ALIGN", "0", "an integer >= 1"),
        ("PAGEDSERVE_BF16_ROW_ALIGN", "sixteen", "an integer >= 1"),
        ("PAGEDSERVE_LOG_FORMAT", "xml", "auto, json or console"),
    ],
)
def test_a_bad_value_fails_naming_the_variable(name: str, value: str, accepts: str) -> None:
    with pytest.raises(envs.EnvError) as info:
        envs.Settings.from_environ({name: value})
    assert str(info.value) == f"{name}={value!r}: it accepts {accepts}"


def test_parsed_once_until_reloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_BF16_WIDEN", raising=False)
    first = envs.reload()
    monkeypatch.setenv("PAGEDSERVE_BF16_WIDEN", "1")
    assert envs.get() is first and not envs.get().bf16_widen
    assert envs.reload().bf16_widen and envs.get().bf16_widen
    assert envs.reload({}) == envs.Settings()


def test_a_bad_value_fails_a_process_at_its_first_read() -> None:
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", "from pagedserve import envs; envs.get()"],
        env={"PAGEDSERVE_CPU_FUSED_OPS": "off", "PATH": ""},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert "PAGEDSERVE_CPU_FUSED_OPS='off': it accepts 0 or 1" in run.stderr


def test_the_architecture_doc_lists_every_switch() -> None:
    """docs/architecture.md, "Environment switches", holds `envs.table()` as it is now."""
    table = envs.table()
    for entry in envs.registry():
        assert f"| `{entry.name}` | {entry.accepts} | {entry.default} |" in table
    assert table in (ROOT / "docs" / "architecture.md").read_text()


def test_product_code_reads_switches_only_through_the_registry() -> None:
    """Every PAGEDSERVE_* name product code mentions is a registered switch or a flag's
    variable (a name ending in `_` is a prefix of some), and only the registry and the
    command line's flag fallback read one from the environment."""
    known = {entry.name for entry in envs.registry()} | flag_variables()
    unknown, direct = [], []
    for path in sources():
        rel = path.relative_to(ROOT)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in NAME.findall(line):
                ok = any(k.startswith(name) for k in known) if name.endswith("_") else name in known
                if not ok:
                    unknown.append(f"{rel}:{number}: {name}")
            if rel not in READERS and DIRECT_READ.search(line):
                direct.append(f"{rel}:{number}: {line.strip()}")
    assert not unknown, "not in pagedserve/envs.py's registry:\n" + "\n".join(unknown)
    assert not direct, "read through pagedserve.envs instead:\n" + "\n".join(direct)
