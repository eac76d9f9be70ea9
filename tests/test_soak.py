"""One minute of the soak (`benchmarks/soak.py`): mixed traffic through `pagedserve up`, the
worker killed and restarted, Redis restarted, and then every greedy answer against a replay."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import soak

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def test_one_minute_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = soak.main(["--minutes", "1", "--concurrency", "8", "--out", str(out)])
    r = json.loads(out.read_text())
    failed = [k for k, ok in r["checks"].items() if not ok]
    assert code == 0 and not failed, (failed, r["mismatches"], r["errors_outside_failover"])
    assert r["replayed"] >= 20, "enough greedy answers were checked to mean something"
    assert r["failover"]["window_s"] is not None
