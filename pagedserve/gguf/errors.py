"""The one error every GGUF module raises."""


class GGUFError(ValueError):
    """The GGUF file is unreadable, or describes something that cannot be served here."""
