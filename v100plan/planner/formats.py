"""Weight formats and KV-cache types: bits per weight and bytes per element, each with its source.

Two kinds of weight format:

- checkpoint formats (fp32 ... nvfp4): the format covers the linear layers; the token embedding
  and the output head stay 16-bit, as the quantizers leave them by default (AutoGPTQ/AutoAWQ
  `lm_head: false`, ModelOpt NVFP4 keeps embeddings and lm_head in bf16).
- GGUF files (q8_0 ... q2_k): llama.cpp mixes tensor types inside one file (q4_k_m puts some
  attention/FFN tensors in q6_k, the output head in q6_k); the figure is the whole file's bits per
  weight, from llama.cpp's own size table for Llama-3-8B (8.03 B parameters; "G" there is GiB, as
  llama-bench prints it: 8B Q4_K_M 4.58 GiB), applied to every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import memory_fit  # stdlib-only

GIB = 2**30
LLAMA3_8B_PARAMS = 8.03e9
_QUANTIZE = "llama.cpp tools/quantize/quantize.cpp QUANT_OPTIONS (ggml-org/llama.cpp@03161a4)"


def _gguf_bpw(gib: float) -> float:
    """Bits per weight of a Llama-3-8B GGUF file of ``gib`` GiB: gib x 2^30 x 8 / 8.03e9."""
    return round(gib * GIB * 8 / LLAMA3_8B_PARAMS, 3)


# AWQ and GPTQ store the same thing: 4-bit weights, a 16-bit scale and a 4-bit zero per group of 128
_G128_BPW = round(4 + (16 + 4) / 128, 3)
_G128 = ("4-bit weights, group 128 with a 16-bit scale and 4-bit zero per group: 4 + (16 + 4) / 128 = "
         f"{_G128_BPW} bits")


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits_per_weight: float       # linear layers (checkpoint formats) or the whole file (GGUF)
    whole_file: bool             # True: GGUF, the figure covers embedding and head too
    family: str                  # "float", "int", "gguf", "exl2": the engine-efficiency key falls back to it
    source: str
    head_bits: float | None = None  # the output head's bits where the format sets them (EXL2: 6); None: 16


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("fp32", 32.0, False, "float", "IEEE 754 binary32: 32 bits"),
    WeightFormat("fp16", 16.0, False, "float", "IEEE 754 binary16: 16 bits"),
    WeightFormat("bf16", 16.0, False, "float", "bfloat16: 16 bits"),
    WeightFormat("fp8", 8.0, False, "float", "FP8 E4M3 weights with one scale per tensor or channel (negligible): 8 bits"),
    WeightFormat("int8", 8.0, False, "int", "int8 weights with a per-channel scale (negligible): 8 bits"),
    WeightFormat("int4-awq", _G128_BPW, False, "int",
                 f"{_G128} (AutoAWQ/GPTQ packing; multigrid.ai 'Group Size in GPTQ and AWQ Quantization', "
                 "overhead = (16 + 4) / g)"),
    WeightFormat("int4-gptq", _G128_BPW, False, "int",
                 f"{_G128} (quantize_config.json bits 4, group_size 128; overhead = (16 + 4) / g)"),
    WeightFormat("groupwise-int", _G128_BPW, False, "int",
                 f"groupwise integer 4-bit, as the field report's 'groupwise-int' file: {_G128} (a catalogue profile "
                 "keeps its own file's bytes)"),
    WeightFormat("int4-autoround", _G128_BPW, False, "int",
                 f"{_G128} (AutoRound, intel/auto-round: bits 4, group_size 128 by default, exported in the GPTQ "
                 "packing: qweight, 16-bit scales, 4-bit qzeros)"),
    WeightFormat("int4-g32", 5.0, False, "int",
                 "4-bit weights, group 32 with a bf16 scale and a bf16 zero per group: 4 + (16 + 16) / 32 = 5 bits "
                 "(pytorch-labs/gpt-fast quantize.py --mode int4 --groupsize 32, scales_and_zeros in bfloat16)"),
    WeightFormat("nvfp4", 4.5, False, "float",
                 "NVFP4: E2M1 4-bit values with one FP8 E4M3 scale per 16 (+ one FP32 per tensor): 4 + 8 / 16 = 4.5 bits "
                 "(Intel Neural Compressor 'NVFP4 Quantization' format table; NeMo AutoModel nvfp4: 0.5625 bytes per parameter)"),
    WeightFormat("q8_0", _gguf_bpw(7.96), True, "gguf", f"{_QUANTIZE}: Q8_0 7.96G @ Llama-3-8B"),
    WeightFormat("q6_k", _gguf_bpw(6.14), True, "gguf", f"{_QUANTIZE}: Q6_K 6.14G @ Llama-3-8B"),
    WeightFormat("q5_k_m", _gguf_bpw(5.33), True, "gguf", f"{_QUANTIZE}: Q5_K_M 5.33G @ Llama-3-8B"),
    WeightFormat("q4_k_m", _gguf_bpw(4.58), True, "gguf", f"{_QUANTIZE}: Q4_K_M 4.58G @ Llama-3-8B"),
    WeightFormat("q4_0", _gguf_bpw(4.34), True, "gguf", f"{_QUANTIZE}: Q4_0 4.34G @ Llama-3-8B"),
    WeightFormat("iq4_xs", 4.25, True, "gguf", f"{_QUANTIZE}: IQ4_XS '4.25 bpw non-linear quantization' (the file's mix not given)"),
    WeightFormat("q3_k_m", _gguf_bpw(3.74), True, "gguf", f"{_QUANTIZE}: Q3_K_M 3.74G @ Llama-3-8B"),
    WeightFormat("q2_k", _gguf_bpw(2.96), True, "gguf", f"{_QUANTIZE}: Q2_K 2.96G @ Llama-3-8B"),
)}

# Formats of catalogue models that are not in the table above keep their own profile's bytes.
ALIASES = {"f16": "fp16", "f32": "fp32", "awq": "int4-awq", "gptq": "int4-gptq", "autoround": "int4-autoround",
           "auto-round": "int4-autoround"}


@dataclass(frozen=True)
class KvDtype:
    name: str
    bytes_per_element: float
    source: str
    scale_bytes_per_vector: float = 0.0   # a scale per position and KV head (head_dim values), where the type has one

    def bytes_for(self, head_dim: int) -> float:
        """Bytes per K or V element for vectors of ``head_dim`` values: the element plus its share of the scale."""
        return memory_fit.kv_element_bytes(self.bytes_per_element, self.scale_bytes_per_vector, head_dim)


KV_DTYPES: dict[str, KvDtype] = {k.name: k for k in (
    KvDtype("fp16", 2.0, "IEEE 754 binary16: 2 bytes"),
    KvDtype("bf16", 2.0, "bfloat16: 2 bytes"),
    KvDtype("fp8", 1.0, "FP8 E4M3/E5M2: 1 byte (vLLM --kv-cache-dtype fp8)"),
    KvDtype("int8", 1.0, "int8 values with one float32 scale per position and KV head: 1 + 4 / head_dim bytes "
            "(the bundled engine's --kv-cache-dtype int8, engine/core/kvquant.py; the field engine's --kv-dtype int8)",
            memory_fit.INT8_SCALE_BYTES),
    KvDtype("q8_0", 34 / 32, "GGML q8_0 block: 32 int8 values + one fp16 scale = 34 bytes per 32 (llama.cpp -ctk/-ctv q8_0)"),
    KvDtype("q4_0", 18 / 32, "GGML q4_0 block: 32 4-bit values + one fp16 scale = 18 bytes per 32 (llama.cpp -ctk/-ctv q4_0)"),
)}


_EXL2 = ("exllamav2 README, 'EXL2 quantization': any average bitrate between 2 and 8 bits per weight, mixed per layer; "
         "the name's figure is that average (scales included), the output head at convert.py's default -hb 6 bits, "
         "the embedding unquantized")


def exl2(bits: float) -> WeightFormat:
    """An EXL2 file of ``bits`` bits per weight on average over the linear layers (exl2-2.5 ... exl2-8.0)."""
    return WeightFormat(f"exl2-{bits:.1f}", bits, False, "exl2", _EXL2, head_bits=6.0)


def weight_format(name: str) -> WeightFormat | None:
    key = name.lower()
    if key.startswith("exl2-"):
        try:
            bits = float(key[5:])
        except ValueError:
            return None
        return exl2(bits) if 2.0 <= bits <= 8.0 else None
    return WEIGHT_FORMATS.get(ALIASES.get(key, key))


def kv_dtype(name: str) -> KvDtype | None:
    return KV_DTYPES.get(name.lower())
