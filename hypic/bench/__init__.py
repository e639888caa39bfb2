"""Benchmarks: TTFT across the mode ladder (``hypic bench ttft``) and model shapes for random-weight runs."""
