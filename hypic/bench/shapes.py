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
    "tiny": dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=512, hidden_size=128, num_hidden_layers=4,
                 full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                 max_position_embeddings=65536, rope_parameters=_QWEN3_5_ROPE),
}
