"""Which chat template the control plane renders chats with: the one `--chat-template` gives
(a file, or the template itself inline: vLLM's rule for telling them apart), else a template
shipped here for a checkpoint whose own template cannot render tools, else the checkpoint's.

Shipped templates live in `control_plane/templates/`. Each stands in for a checkpoint template
it matches exactly, and renders every chat without tools, tool calls or tool messages exactly
as that template does (tests/test_chat_templates.py checks it against the checkpoint's):

* `smollm2-instruct.jinja`: SmolLM2-Instruct's ChatML (the built-in model), with SmolLM2's
  function-calling format for tools, calls and results.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import NamedTuple

from control_plane.chat import check_template

TEMPLATES_DIR = Path(__file__).parent / "templates"
SMOLLM2_INSTRUCT = TEMPLATES_DIR / "smollm2-instruct.jinja"
# SmolLM2-135M/360M/1.7B-Instruct's own template (tokenizer_config.json, and the GGUF files'
# tokenizer.chat_template): ChatML that renders a message's role and content only.
SMOLLM2_CHECKPOINT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SHIPPED = {SMOLLM2_CHECKPOINT_TEMPLATE: SMOLLM2_INSTRUCT}
# A value of --chat-template holding one of these is a template, not a file name (vLLM's rule).
_TEMPLATE_CHARS = "{}\n"


class ChatTemplate(NamedTuple):
    text: str | None  # None: the model has none, and chats are refused
    source: str  # "--chat-template", "shipped:<file name>", "checkpoint" or "none"


def load_chat_template(value: str) -> str:
    """The template `--chat-template value` names: the text of the file at that path, else
    `value` itself when it holds template syntax (braces or a newline). Raises ValueError for
    a path that cannot be read or a template that does not parse."""
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ValueError(
                f"--chat-template {value!r} is neither a readable file ({exc.strerror}) nor a "
                "template"
            ) from None
        text = value
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {value}: the file is not UTF-8 text") from None
    check_template(text)
    return text


@cache
def _shipped_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def choose_chat_template(checkpoint: str | None, override: str | None = None) -> ChatTemplate:
    """The template to render chats with, given the checkpoint's and `--chat-template`'s text
    (loaded by load_chat_template)."""
    if override is not None:
        return ChatTemplate(override, "--chat-template")
    shipped = _SHIPPED.get(checkpoint) if checkpoint is not None else None
    if shipped is not None:
        return ChatTemplate(_shipped_text(shipped), f"shipped:{shipped.name}")
    return ChatTemplate(checkpoint, "checkpoint" if checkpoint is not None else "none")
