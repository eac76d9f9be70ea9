"""POST /v1/chat/completions: its body, its serving and its route."""
