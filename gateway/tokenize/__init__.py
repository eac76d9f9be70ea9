"""vLLM's POST /tokenize and /detokenize: their bodies, their serving and their routes."""
