"""Config dicts of real model shapes, for random-weight benchmarks (hypic.models.random_init)."""

from __future__ import annotations

from typing import Any

_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=4096,
                       num_hidden_layers=32, full_attention_interval=4, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, intermediate_size=12288, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                       rope_parameters=_QWEN3_5_ROPE, tie_word_embeddings=False, attn_output_gate=True),
    "qwen3.5-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], vocab_size=248320, hidden_size=2048,
                            num_hidden_layers=40, full_attention_interval=4, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                            max_position_embeddings=262144, rope_parameters=_QWEN3_5_ROPE,
                            tie_word_embeddings=False, attn_output_gate=True),
    # Qwen3-Next-80B-A3B (79.7 B parameters): 160 GB in bf16, more than one H200 holds; with
    # --quantization fp8 its projections and experts take 80 GB
    "qwen3-next-80b-a3b": dict(architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
                               num_hidden_layers=48, full_attention_interval=4, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, intermediate_size=5120, num_experts=512,
                               num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                               norm_topk_prob=True, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               rms_norm_eps=1e-6, max_position_embeddings=262144, partial_rotary_factor=0.25,
                               rope_theta=5e6, tie_word_embeddings=False),
    # MiniMax-Text-01 / M1 cut to its first group of 8 layers (7 lightning, 1 softmax) of 80: each layer
    # at its real size (32 experts of 9216 · 6144, top 2; 64 lightning heads of 128), ≈ 43 B parameters.
    "minimax-m1-8l": dict(architectures=["MiniMaxM1ForCausalLM"], vocab_size=200064, hidden_size=6144,
                          num_hidden_layers=8, attn_type_list=[0] * 7 + [1], num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, intermediate_size=9216, num_local_experts=32,
                          num_experts_per_tok=2, shared_intermediate_size=0, rope_theta=1e7, rotary_dim=64,
                          rms_norm_eps=1e-5, max_position_embeddings=10240000, postnorm=True,
                          layernorm_full_attention_alpha=3.5565588200778455, layernorm_full_attention_beta=1.0,
                          layernorm_linear_attention_alpha=3.5565588200778455, layernorm_linear_attention_beta=1.0,
                          layernorm_mlp_alpha=3.5565588200778455, layernorm_mlp_beta=1.0, tie_word_embeddings=False),
    "tiny": dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=512, hidden_size=128, num_hidden_layers=4,
                 full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                 max_position_embeddings=65536, rope_parameters=_QWEN3_5_ROPE),
}
