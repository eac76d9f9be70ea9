"""The committed stubs are exactly what `make protos` generates from the .proto sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_sources(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "protos/v1").glob("*_pb2*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "protos/v1").glob("*_pb2*"))
    assert generated == committed
    for rel in generated:
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text(), f"{rel} is stale"
