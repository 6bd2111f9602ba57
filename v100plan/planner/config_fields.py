"""Every config.json field the planner knows, and what it does with the rest.

A field is either *read* (a term of the arithmetic: from_config.py, config_features.py), *inert* (it changes
neither the bytes a round reads nor the work it does: token ids, norm epsilons, dropout, training-only router
losses, logit soft-capping), or *refused* (a structure that changes bytes or work the planner has no formula
for: a plan would be silently wrong, so it is exit 2 naming the field). Any other field is *unmodelled*: the
plan goes on, says "unmodelled: FIELD" and widens its intervals (uncertainty.py), never silent.
"""

from __future__ import annotations

from typing import Any

READ = frozenset({
    "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "layer_types", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "attn_output_gate", "intermediate_size", "moe_intermediate_size",
    "num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
    "shared_expert_intermediate_size", "first_k_dense_replace", "mlp_only_layers", "moe_layer_freq",
    "decoder_sparse_step", "interleave_moe_layer_step", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "max_position_embeddings", "original_max_position_embeddings",
    "rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor", "tie_word_embeddings",
    "mtp_num_hidden_layers", "num_nextn_predict_layers", "sliding_window", "use_sliding_window", "max_window_layers",
    "sliding_window_pattern", "_sliding_window_pattern", "attention_chunk_size", "quantization_config", "torch_dtype",
    "dtype", "text_config", "vision_config", "cross_attention_layers", "index_topk",
})
INERT = frozenset({
    "_name_or_path", "_comment", "architectures", "model_type", "transformers_version", "auto_map", "bos_token_id",
    "eos_token_id", "pad_token_id", "decoder_start_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "vision_token_id", "image_token_index", "hidden_act", "hidden_activation", "rms_norm_eps",
    "layer_norm_eps", "layer_norm_epsilon", "initializer_range", "attention_dropout", "hidden_dropout", "embd_pdrop",
    "resid_pdrop", "dropout", "attention_bias", "mlp_bias", "qkv_bias", "use_cache", "pretraining_tp",
    "output_router_logits", "router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise", "aux_loss_alpha",
    "seq_aux", "norm_topk_prob", "scoring_func", "topk_method", "routed_scaling_factor", "n_group", "topk_group",
    "ep_size", "id2label", "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward", "return_dict",
    "output_attentions", "output_hidden_states", "torchscript", "tokenizer_class", "use_qk_norm", "rope_interleave",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "clip_qkv", "swiglu_alpha",
    "swiglu_limit", "use_bidirectional_attention", "use_bfloat16", "tie_encoder_decoder", "cache_implementation",
    "rope_type", "keys_to_ignore_at_inference", "bias",
})
# field (or prefix ending in "*") -> what it is
REFUSED = {
    "hidden_size_per_layer_input": "per-layer embeddings (an extra embedding table read per layer per token)",
    "vocab_size_per_layer_input": "per-layer embeddings (an extra embedding table read per layer per token)",
    "altup_*": "AltUp (several residual streams per token)",
    "laurel_rank": "LAuReL low-rank residual branches",
    "activation_sparsity_pattern": "activation sparsity (a share of the MLP skipped per token)",
    "num_kv_shared_layers": "K/V shared across layers (fewer K/V reads than layers)",
    "hc_*": "hyper-connections (several residual streams mixed per layer)",
    "hyper_connection*": "hyper-connections (several residual streams mixed per layer)",
    "num_hyper_connections": "hyper-connections (several residual streams mixed per layer)",
    "ngram*": "n-gram embeddings (extra tables read per token)",
    "engram*": "n-gram memory tables (extra tables read per token)",
    "index_n_heads": "a sparse-attention indexer (top-k K/V positions per token)",
    "index_head_dim": "a sparse-attention indexer (top-k K/V positions per token)",
}


def refused(field: str) -> str | None:
    """What a refused field is (REFUSED, exact or by prefix); None for any other."""
    if field in REFUSED:
        return REFUSED[field]
    return next((what for key, what in REFUSED.items() if key.endswith("*") and field.startswith(key[:-1])), None)


def unknown(cfg: dict[str, Any], outer: dict[str, Any] | None = None) -> list[str]:
    """Fields of the (text) config and of its multimodal wrapper that are neither read, inert nor refused."""
    fields = set(cfg) | set(outer or {})
    return sorted(f for f in fields if f not in READ and f not in INERT and refused(f) is None)
