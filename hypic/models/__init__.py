"""Hybrid-attention model families, loaded from local Hugging Face folders, run over packed runs
with a ForwardContext that supplies every layer's incoming state."""
