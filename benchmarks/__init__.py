"""Benchmarks: each file measures one thing and writes JSON under benchmarks/results/."""
