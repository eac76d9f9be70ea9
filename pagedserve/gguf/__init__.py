"""GGUF checkpoints (llama.cpp's one-file format) read as what a Hugging Face directory holds.

`open_gguf(path)` validates a file and returns a `GGUFCheckpoint`: its HF `config.json` and
`generation_config.json` contents, its tensors under HF names (dequantized, llama.cpp's Q/K row
order undone), its tokenizer and chat template. `convert_gguf` writes that out as a directory
that transformers and vLLM load as they are.

Modules import one way: `errors` <- `tensors`, `tokenizer` <- `checkpoint` <- `convert`.
"""

from pagedserve.gguf.checkpoint import GGUFCheckpoint, find_gguf, open_gguf
from pagedserve.gguf.convert import convert_gguf
from pagedserve.gguf.errors import GGUFError

__all__ = ["GGUFCheckpoint", "GGUFError", "convert_gguf", "find_gguf", "open_gguf"]
