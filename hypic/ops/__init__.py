"""The algebra and kernels of hypic: linear-state summaries, chunked linear attention, short
convolution and RoPE. Plain tensors in, plain tensors out: no nn.Module, no engine imports."""
