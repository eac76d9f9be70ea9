"""Chat templates: the one shipped for the built-in model (SmolLM2-Instruct), which renders
tools, tool calls and tool results; `--chat-template` (a file or inline) on the control plane
and through `up`; `chat_template_kwargs` reaching the template.

Without a server: the shipped template against the checkpoint's own on chats without tools
(identical text), a conversation with tool calls and results rendered, the flag's rules, the
kwargs' rules, SmolLM2's call lists parsed back into tool calls. With servers: a micro model
whose control plane renders a `--chat-template` file and an inline one; `up` on the default
model answering `tool_choice` "auto" (and its calls coming back as tool_calls), and `up`
passing `--chat-template` to its control plane.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.chat import render_chat, template_message
from control_plane.chat_templates import (
    SMOLLM2_CHECKPOINT_TEMPLATE,
    SMOLLM2_INSTRUCT,
    choose_chat_template,
    load_chat_template,
)
from control_plane.config import ControlPlaneConfig
from control_plane.tokenizer import LoadedTokenizer, load_tokenizer
from gateway.tool_parsers import HermesParser, Parsed, merge_calls
from pagedserve.cli.main import build_parser
from pagedserve.cli.model_source import smollm2_gguf
from pagedserve.sampling_params import InvalidRequestError
from protos.v1 import control_plane_pb2 as pb
from tests.gateway_stack import HttpProcess, Processes
from tests.procs import ServerProcess, drain, free_port, read_until
from tests.stack import start_stack

CHAT = "/v1/chat/completions"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# The next turn of an agent loop: the assistant's calls and a tool message for each.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "Weather in Paris, and the time in CET?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]
# What the shipped template makes of CONVERSATION's last three messages.
RENDERED_TURNS = (
    "<|im_start|>assistant\n"
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"timezone": "CET"}}]</tool_call><|im_end|>\n'
    "<|im_start|>tool\n"
    '<tool_response name="get_weather">\n21 C, sunny\n</tool_response>\n'
    '<tool_response name="get_time">\n12:00\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)
# A custom template: the tools' names, a kwarg, each message with its calls and what it answers.
CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% if greeting is defined %}<|system|>\n{{ greeting }}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for c in message.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }}]{% endfor %}"
    "{% if message.tool_call_id %}[answers {{ message.tool_call_id }}]{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def as_template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the control plane hands them to a template: through the gateway's
    ChatMessage fields (tool calls as JSON) and control_plane.chat.template_message."""
    out = []
    for m in messages:
        msg = pb.ChatMessage(role=m["role"], content=m.get("content") or "")
        if "tool_calls" in m:
            msg.tool_calls_json = json.dumps(m["tool_calls"])
        if "tool_call_id" in m:
            msg.tool_call_id = m["tool_call_id"]
        out.append(template_message(msg))
    return out


@pytest.fixture(scope="module")
def smollm2() -> LoadedTokenizer:
    return load_tokenizer(smollm2_gguf())


# -- the shipped SmolLM2-Instruct template ------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": " two  spaces\n"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_shipped_template_renders_plain_chats_as_the_checkpoint_does(
    smollm2: LoadedTokenizer, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = smollm2.chat_template
    assert ours == SMOLLM2_INSTRUCT.read_text()  # the GGUF's own is replaced
    own = render_chat(SMOLLM2_CHECKPOINT_TEMPLATE, messages, add_generation_prompt, {})
    assert render_chat(ours, messages, add_generation_prompt, {}) == own


def test_shipped_template_stands_in_only_for_smollm2s() -> None:
    assert choose_chat_template(SMOLLM2_CHECKPOINT_TEMPLATE).source == "shipped:" + (
        SMOLLM2_INSTRUCT.name
    )
    assert choose_chat_template("{{ messages }}") == ("{{ messages }}", "checkpoint")
    assert choose_chat_template(None) == (None, "none")
    chosen = choose_chat_template(SMOLLM2_CHECKPOINT_TEMPLATE, "{{ x }}")
    assert chosen == ("{{ x }}", "--chat-template")


def test_smollm2_renders_tools_in_its_function_calling_prompt(smollm2: LoadedTokenizer) -> None:
    """Before, the built-in model's template rendered no tools, and tool_choice "auto" was a
    400."""
    prompt = smollm2.chat_prompt(USER, True, [WEATHER, TIME])
    tools = prompt.text.split("<tools>", 1)[1].split("</tools>", 1)[0]
    assert json.loads(tools) == [WEATHER, TIME]
    assert prompt.text.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '<tool_call>[\n{"name": "func_name1", "arguments": {' in prompt.text
    assert prompt.text.endswith(
        "]</tool_call><|im_end|>\n<|im_start|>user\n"
        "What is the weather like in Paris today?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_conversation_renders_its_tool_calls_and_results(smollm2: LoadedTokenizer) -> None:
    """The assistant's tool_calls and the tool messages answering them (by tool_call_id) are in
    the prompt; SmolLM2's own template rendered the assistant turn empty."""
    messages = as_template_messages(CONVERSATION)
    prompt = smollm2.chat_prompt(messages, True, [WEATHER, TIME])
    assert prompt.text.startswith("<|im_start|>system\nAnswer in one sentence.\n\nYou are an")
    assert prompt.text.endswith(RENDERED_TURNS), prompt.text
    # Without tools (tool_choice "none"), the history still shows the calls and results.
    plain = smollm2.chat_prompt(messages, True).text
    assert plain.startswith("<|im_start|>system\nAnswer in one sentence.<|im_end|>\n")
    assert plain.endswith(RENDERED_TURNS)
    # Special-token text typed in a result stays text: the template leaves contents whole.
    typed = [*messages[:-1], {**messages[-1], "content": "<|im_end|>"}]
    assert smollm2.chat_prompt(typed, True).literal
    # Arguments that hold no JSON object are written as they were sent.
    call = {
        "id": "call_3",
        "type": "function",
        "function": {"name": "get_time", "arguments": "CET"},
    }
    odd = as_template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert '"arguments": CET}]</tool_call>' in render_chat(smollm2.chat_template, odd, False, {})


def test_tools_and_kwargs_must_not_hold_special_tokens(smollm2: LoadedTokenizer) -> None:
    sneaky = {**WEATHER, "function": {**WEATHER["function"], "description": "<|im_end|>"}}
    with pytest.raises(InvalidRequestError, match="^tools must not"):
        smollm2.chat_prompt(USER, True, [sneaky])
    with pytest.raises(InvalidRequestError, match="^chat_template_kwargs: must not"):
        smollm2.chat_prompt(USER, True, None, {"x": "<|im_start|>"})


# -- SmolLM2's call lists back into tool calls --------------------------------------------------


def parse(text: str, pieces: int = 1) -> Parsed:
    parser = HermesParser({"get_weather", "get_time"})
    out = Parsed()
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        got = parser.feed(text[i : i + step])
        out.content += got.content
        out.calls += got.calls
    end = parser.finish()
    out.content += end.content
    out.calls += end.calls
    return out


@pytest.mark.parametrize("pieces", [1, 3, 17, 1000])
def test_a_call_list_becomes_tool_calls(pieces: int) -> None:
    text = (
        'Checking.<tool_call>[{"name": "get_weather", "arguments": {"city":"Paris"}}, '
        '{"name": "get_time", "arguments": {"timezone": "CET"}}]</tool_call>'
    )
    out = parse(text, pieces)
    assert out.content == "Checking."
    calls = [c["function"] for c in merge_calls(out.calls)]
    # Arguments as the model wrote them, spacing included.
    assert calls == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"name": "get_time", "arguments": '{"timezone": "CET"}'},
    ]


@pytest.mark.parametrize("pieces", [1, 5])
def test_call_lists_with_no_call_or_a_stranger(pieces: int) -> None:
    empty = parse("<tool_call>[]</tool_call>", pieces)
    assert empty.content == "" and not empty.calls  # SmolLM2's "no call needed"
    stranger = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "rm"}]</tool_call>'
    out = parse(stranger, pieces)
    assert out.content == stranger and not out.calls  # all or nothing


# -- --chat-template and chat_template_kwargs, without servers ----------------------------------


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(CUSTOM_TEMPLATE)
    assert load_chat_template(str(path)) == CUSTOM_TEMPLATE
    assert load_chat_template(CUSTOM_TEMPLATE) == CUSTOM_TEMPLATE
    with pytest.raises(ValueError, match="neither a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="line 1"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse"):
        ControlPlaneConfig(workers=("127.0.0.1:1",), chat_template="{{ unclosed")
    for command in (["control-plane", "--workers", "127.0.0.1:1"], ["up"]):
        a = build_parser().parse_args([*command, "--chat-template", str(path)])
        assert a.chat_template == str(path)


def test_chat_template_kwargs_reach_the_template() -> None:
    tok = load_tokenizer(smollm2_gguf(), chat_template=CUSTOM_TEMPLATE)
    assert tok.chat_template == CUSTOM_TEMPLATE
    text = tok.chat_prompt(USER, True, None, {"greeting": "Bonjour"}).text
    assert "<|system|>\nBonjour<|im_end|>\n<|user|>" in text
    assert "Bonjour" not in tok.chat_prompt(USER, True).text
    # Over the special tokens' texts, as transformers' apply_chat_template(**kwargs).
    assert tok.chat_prompt(USER, False, None, {"bos_token": ""}).text.startswith("<|user|>")


# -- servers: a micro model with --chat-template -------------------------------------------------


@pytest.fixture(scope="module")
def custom_gateway(
    micro_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
    module_spawn: Callable[..., ServerProcess],
) -> Iterator[HttpProcess]:
    path = tmp_path_factory.mktemp("template") / "custom.jinja"
    path.write_text(CUSTOM_TEMPLATE)
    stack = start_stack(
        module_spawn, micro_llama, num_gpu_blocks=64, cp_args=("--chat-template", str(path))
    )
    procs = Processes()
    try:
        yield procs.gateway(stack.address)
    finally:
        procs.stop_all()


def rendered(http: httpx.Client, **body: Any) -> str:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return str(http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"])


def test_control_plane_renders_its_chat_template_file(custom_gateway: HttpProcess) -> None:
    """The micro model's own template renders no tools; the file given to the control plane
    does, and reads chat_template_kwargs, on /tokenize and on chat completions."""
    with httpx.Client(base_url=custom_gateway.url, timeout=120) as http:
        text = rendered(http, messages=USER, tools=[WEATHER, TIME])
        assert "Tools: get_weather get_time" in text
        greeted = rendered(http, messages=USER, chat_template_kwargs={"greeting": "Bonjour"})
        assert "<|system|>\nBonjour" in greeted and "Bonjour" not in rendered(http, messages=USER)
        turns = rendered(http, messages=CONVERSATION)
        assert "[call call_1 get_weather][call call_2 get_time]" in turns
        assert "12:00[answers call_2]" in turns
        body = {"messages": USER, "tools": [WEATHER], "max_tokens": 2}
        r = http.post(CHAT, json={**body, "chat_template_kwargs": {"greeting": "Hi"}})
        assert r.status_code == 200, r.text
        bad_kwargs: list[dict[str, Any]] = [{"messages": []}, {"x": "</s>"}]
        for bad in bad_kwargs:
            for path, req in ((CHAT, body), ("/tokenize", {"messages": USER})):
                r = http.post(path, json={**req, "chat_template_kwargs": bad})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_control_plane_takes_an_inline_chat_template(
    micro_llama: Path, spawn: Callable[..., ServerProcess]
) -> None:
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    stack = start_stack(spawn, micro_llama, num_gpu_blocks=16, cp_args=("--chat-template", inline))
    req = pb.TokenizeRequest()
    req.chat.messages.add(role="user", content="hello")
    ids = list(stack.stub.Tokenize(req, timeout=60).token_ids)
    text = stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=60).text
    assert text.endswith("[user] hello\n[assistant]"), text


def test_control_plane_refuses_a_missing_template_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jinja")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve.cli",
            "control-plane",
            "--workers",
            "127.0.0.1:1",
            "--port",
            str(free_port()),
            "--chat-template",
            missing,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "neither a readable file" in out.stderr, out.stderr


# -- `up`: the default model with tools, and --chat-template passed through ---------------------


def start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`pagedserve up` with `args`, running; its gateway's URL."""
    http_port = free_port()
    argv = [sys.executable, "-m", "pagedserve.cli", "up", "--grpc-port", str(free_port())]
    argv += ["--worker-base-port", str(free_port()), "--port", str(http_port)]
    argv += ["--kv-cache-memory", "64MiB", "--warmup-batch-size", "0", *args]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = read_until(proc, "pagedserve is up", 300)
    if not any("pagedserve is up" in x for x in lines):
        stop_up(proc)
        pytest.fail("".join(lines)[-3000:])
    drain(proc, lines)
    return proc, f"http://127.0.0.1:{http_port}"


def stop_up(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)


def test_up_default_model_answers_tool_choice_auto(tmp_path: Path) -> None:
    """The agent loop on the built-in model: tools with tool_choice "auto" (the default) are
    a 200 (they were a 400); a call written in SmolLM2's format comes back as tool_calls; the
    next turn, with the calls and their results, renders them."""
    proc, url = start_up(tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 8, "temperature": 0}
            for choice in (None, "auto"):
                r = http.post(CHAT, json={**body, **({"tool_choice": choice} if choice else {})})
                assert r.status_code == 200, r.text
            # The model writes what the regex lets it: a call list as its prompt asks.
            written = (
                '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
            )
            forced = {**body, "max_tokens": 60, "guided_regex": re.escape(written)}
            r = http.post(CHAT, json=forced)
            assert r.status_code == 200, r.text
            [c] = r.json()["choices"]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
            [call] = c["message"]["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            # The next turn.
            turn = [*USER, {**CONVERSATION[2], "tool_calls": [{**call, "id": "call_9"}]}]
            turn.append({"role": "tool", "tool_call_id": "call_9", "content": "21 C, sunny"})
            text = rendered(http, messages=turn, tools=[WEATHER, TIME])
            assert text.endswith(
                '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}]</tool_call><|im_end|>\n<|im_start|>tool\n'
                '<tool_response name="get_weather">\n21 C, sunny\n</tool_response><|im_end|>\n'
                "<|im_start|>assistant\n"
            ), text
            r = http.post(CHAT, json={**body, "messages": turn})
            assert r.status_code == 200, r.text
    finally:
        stop_up(proc)


def test_up_passes_chat_template_to_its_control_plane(micro_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "custom.jinja").write_text(CUSTOM_TEMPLATE)
    # A path relative to where `up` runs.
    proc, url = start_up(tmp_path, "--model", str(micro_llama), "--chat-template", "custom.jinja")
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            text = rendered(http, messages=USER, chat_template_kwargs={"greeting": "Bonjour"})
            assert "<|system|>\nBonjour" in text, text
    finally:
        stop_up(proc)
