"""The model and its decode step: config, weights, tokenizer, sampling, tensor-parallel sharding, the demo model,
the runner (chunked prefill, the captured decode step) and `generate`.
"""
