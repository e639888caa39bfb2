"""Building blocks shared by the model families: norms, MLP/MoE, linear-attention mixers, attention."""
