"""Training the bundled tiny hybrid model on the synthetic task suite (run on the GPU machine in
short resumable runs; see docs/training.md)."""
