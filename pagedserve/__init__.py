"""pagedserve: LLM serving on PagedAttention."""

__version__ = "0.1.0"
