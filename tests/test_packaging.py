"""What `make up` and the images install: the runtime dependencies only. Test, lint and codegen
tools, and transformers (the tests' reference), are dev extras that nothing `pagedserve` runs
imports: the cluster serves with transformers and grpc_tools made unimportable."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.procs import drain, free_port, read_until

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = ("pagedserve", "control_plane", "gateway", "gpu_worker", "kernels", "protos")
DEV_ONLY = {
    "transformers", "grpcio-tools", "pytest", "pytest-timeout", "pytest-xdist", "hypothesis",
    "mypy", "ruff", "schemathesis", "matplotlib", "openai", "accelerate", "jsonschema",
    "xgrammar",
}  # fmt: skip
# Imported only behind a flag that says how to install it when missing (`--plot`).
OPTIONAL_IMPORTS = {"matplotlib"}
BLOCKED = ("transformers", "grpc_tools")


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_runtime_dependencies_leave_out_the_dev_tools() -> None:
    project = _project()
    runtime, dev = _names(project["dependencies"]), _names(project["optional-dependencies"]["dev"])
    assert not runtime & DEV_ONLY, sorted(runtime & DEV_ONLY)
    assert {"transformers", "grpcio-tools", "pytest", "ruff", "mypy"} <= dev


def _runtime_closure() -> set[str]:
    """Distributions the runtime dependencies pull in (as installed here), recursively."""
    seen: set[str] = set()
    stack = [Requirement(r) for r in _project()["dependencies"]]
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        stack += [Requirement(r) for r in importlib.metadata.requires(name) or []]
    return seen


def _imported_modules(package: str) -> dict[str, str]:
    """Top-level modules the package's code imports -> a file importing each."""
    out: dict[str, str] = {}
    for file in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                out.setdefault(name.split(".")[0], str(file.relative_to(ROOT)))
    return out


def test_every_module_the_runtime_imports_comes_with_the_runtime_dependencies() -> None:
    closure = _runtime_closure()
    assert not closure & {"transformers", "grpcio-tools"}
    providers = importlib.metadata.packages_distributions()
    first_party = {*RUNTIME_PACKAGES, "simulator"}
    missing = []
    for package in (*RUNTIME_PACKAGES, "simulator"):
        for module, file in _imported_modules(package).items():
            if module in sys.stdlib_module_names or module in first_party | OPTIONAL_IMPORTS:
                continue
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            if not dists & closure:
                missing.append(f"{module} ({file})")
    assert not missing, missing


def test_the_dockerfile_builds_every_package_and_installs_no_extras() -> None:
    text = (ROOT / "Dockerfile").read_text()
    with open(ROOT / "pyproject.toml", "rb") as f:
        included = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+) \1$", text, flags=re.MULTILINE))
    assert {pattern.rstrip("*") for pattern in included} <= copied
    installs = re.findall(r"pip install [^\n]*", text)
    assert installs and not any("[" in line for line in installs), installs


def _make_dry_run(target: str) -> str:
    out = subprocess.run(
        ["make", "-n", target, "VENV=/nonexistent-venv"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_up_installs_the_runtime_and_make_test_the_dev_extras() -> None:
    up = _make_dry_run("up")
    assert "pip install -q -e .\n" in up and "[dev]" not in up
    assert "/nonexistent-venv/bin/pagedserve up" in up
    test = _make_dry_run("test")
    assert "pip install -q -e '.[dev]'" in test and "pytest" in test


SITECUSTOMIZE = f"""
import importlib.abc
import sys

BLOCKED = {BLOCKED!r}


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not a runtime dependency)")
        return None


sys.meta_path.insert(0, NotInstalled())
"""


@pytest.fixture
def without_dev_tools(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes (and their children) cannot import transformers or
    grpc_tools, as after `make up` on a fresh machine."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    path = os.pathsep.join(p for p in (str(site), clean.get("PYTHONPATH", "")) if p)
    env = {**clean, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def test_the_entry_points_import_without_dev_tools(without_dev_tools: dict[str, str]) -> None:
    env = without_dev_tools
    blocked = _python("import transformers", env)
    assert blocked.returncode != 0 and "not a runtime dependency" in blocked.stderr
    code = (
        "import pagedserve.cli.main, pagedserve.cli.cluster, pagedserve.cli.model_source, "
        "pagedserve.gguf, pagedserve.grammar, pagedserve.cli.client, control_plane.server, "
        "control_plane.tokenizer, gateway.server, gpu_worker.server, gpu_worker.checkpoint, "
        "simulator.cli\n"
        "p = pagedserve.cli.main.build_parser()\n"
        "for argv in (['up'], ['worker'], ['control-plane', '--workers', 'h:1'], ['gateway'], "
        "['generate', '--prompt', 'x'], ['stats'], ['model', 'convert', 'a.gguf', 'd'], "
        "['bench', 'serve'], ['simulate']):\n"
        "    p.parse_args(argv)\n"
        "print('ok')"
    )
    out = _python(code, env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_cluster_serves_without_dev_tools(
    without_dev_tools: dict[str, str], micro_llama: Path, tmp_path: Path
) -> None:
    """`model convert` of a GGUF, then `up` on the result, a completion constrained to JSON (the
    grammar path) and `pagedserve stats`, with transformers and grpc_tools unimportable."""
    from tests.gguf_files import Q, write_gguf

    env = without_dev_tools
    gguf = write_gguf(micro_llama, tmp_path / "micro.gguf", lambda name, shape: Q.F32)
    converted = tmp_path / "converted"
    cli = [sys.executable, "-m", "pagedserve.cli"]
    out = subprocess.run(
        [*cli, "model", "convert", str(gguf), str(converted)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    http_port, grpc_port = free_port(), free_port()
    argv = [
        *cli, "up", "--model", str(converted), "--port", str(http_port),
        "--grpc-port", str(grpc_port), "--worker-base-port", str(free_port()),
        "--kv-cache-memory", "4MiB", "--swap-space", "0", "--warmup-batch-size", "1",
        "--redis-url", "", "--log-format", "json",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    try:
        lines += read_until(proc, "pagedserve is up", 300)
        assert "pagedserve is up" in "".join(lines), "".join(lines)[-4000:]
        drain(proc, lines)
        body = {
            "prompt": "x",
            "max_tokens": 4,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        }
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        reply = httpx.post(url, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        stats = subprocess.run(
            [*cli, "stats", "--control-plane", f"127.0.0.1:{grpc_port}", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert stats.returncode == 0, stats.stderr
        assert int(json.loads(stats.stdout)["num_requests_finished"]) >= 1
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert "not a runtime dependency" not in text and "Traceback" not in text, text[-4000:]
