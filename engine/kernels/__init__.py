"""engine.kernels: the decode and prefill Triton kernels by family (GEMV bf16/fp16, GEMV int4, the exchange,
Gated DeltaNet chunk, RMSNorm rows, rounding), each beside the plain torch reference its tests use; the bottom floor
of the engine (docs/engine.md, the layout)."""
