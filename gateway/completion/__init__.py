"""POST /v1/completions: its body, its serving and its route."""
