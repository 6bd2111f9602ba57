"""Launch commands for the recommended strategy, for engines that run it themselves.

Each command is a list of argv words (so a test can hand it to the engine's own argument parser, and
a person can join it with spaces). MODEL stands for the model path or Hugging Face id, HEAD_IP for the
first node's address. Flags as the engines document them:

- vLLM: `vllm serve MODEL --tensor-parallel-size N --pipeline-parallel-size M --max-model-len CTX
  --kv-cache-dtype fp8`; across nodes a Ray cluster first (`ray start --head --port=6379` on the head,
  `ray start --address=HEAD_IP:6379` on every other node), then `vllm serve` on the head with
  `--distributed-executor-backend ray`.
- SGLang: `python -m sglang.launch_server --model-path MODEL --tp N --nnodes M --node-rank i
  --dist-init-addr HEAD_IP:50000` on every node i (--tp counts every GPU of every node).
- llama.cpp: `llama-server -m MODEL.gguf -ngl 99 -c CTX --split-mode layer`, and `-fa on -ctk T -ctv T`
  for a quantized KV cache.
- the bundled engine: `python -m engine serve --model MODEL --device cuda:0,cuda:1 --max-context CTX --dtype D`
  (+ `--kv-cache-dtype int8`, `--speculative mtp --draft-tokens K` where the plan has them, `--max-concurrency C`
  where it plans C > 1 sequences); its two ranks on one
  card (`--device cuda:0,cuda:0`) for single, one service per card for replicas; it does not split layers.
- TensorRT-LLM: `trtllm-serve MODEL --tp_size N --pp_size M --max_seq_len CTX` (its OpenAI-compatible server; the
  dtype is the checkpoint's).

Per strategy: `replicas` is one instance per card, each its own process on its own port with
`CUDA_VISIBLE_DEVICES=i` (the command's `env`), none split; `layer_split` is llama.cpp's `--split-mode layer`
and vLLM's `--pipeline-parallel-size 2`; the tensor-parallel strategies are one instance over their cards.

The dtype is the weights' own where the file is 16-bit (an fp16 checkpoint is served in float16, bf16 in
bfloat16), float16 for the GPTQ/AWQ 4-bit formats (their kernels take fp16 activations), and the card's default
otherwise; float16 always on a card without native bf16 (Volta).
"""

from __future__ import annotations

from typing import Any

_BASE_PORT = {"vllm": 8000, "sglang": 30000, "llamacpp": 8080, "tensorrt-llm": 8000, "v100plan": 8000}   # each engine's own default port
_VLLM_KV = {"fp8": "fp8"}            # vLLM's --kv-cache-dtype takes auto or fp8 variants
_LLAMACPP_KV = {"q8_0": "q8_0", "q4_0": "q4_0", "fp16": "f16", "bf16": "bf16"}


def launch_dtype(fmt: str, native_bf16: bool) -> str:
    """The dtype the engine is told to run (module docstring)."""
    if not native_bf16 or fmt in ("fp16", "f16", "int4-gptq", "int4-awq", "gptq", "awq"):
        return "float16"
    return "bfloat16"


def launch_commands(kind: str, model: Any, lay: Any, nodes: int, target: Any, dtype: str,
                    draft_tokens: int = 0) -> list[dict[str, Any]]:
    """[{"node": "all" | "head" | "node i" | "replica i", "argv": [...], "env": {...}?}] for ``kind``; [] when the
    engine has none. A replicas layout gives one instance per card (module docstring)."""
    if kind == "v100plan":
        return _bundled(model, lay, target, dtype, draft_tokens)
    one = _instance(kind, model, lay, nodes, target, dtype)
    if lay.name != "replicas" or not one:
        return one
    port_flag = "--port"
    cmds = []
    for i in range(lay.streams):
        argv = one[0]["argv"] + [port_flag, str(_BASE_PORT.get(kind, 8000) + i)]
        cmds.append({"node": f"replica {i}", "argv": argv, "env": {"CUDA_VISIBLE_DEVICES": str(i)}})
    return cmds


def _instance(kind: str, model: Any, lay: Any, nodes: int, target: Any, dtype: str) -> list[dict[str, Any]]:
    ctx = str(target.context_tokens)
    kv = getattr(model, "kv_dtype", "")
    if kind == "vllm":
        pp = 2 if lay.name == "layer_split" else lay.pp
        serve = ["vllm", "serve", "MODEL", "--tensor-parallel-size", str(lay.tp), "--pipeline-parallel-size", str(pp),
                 "--max-model-len", ctx, "--dtype", dtype]
        if kv in _VLLM_KV:
            serve += ["--kv-cache-dtype", _VLLM_KV[kv]]
        if lay.pp > 1:
            serve += ["--distributed-executor-backend", "ray"]
            cmds = [{"node": "head", "argv": ["ray", "start", "--head", "--port=6379"]}]
            cmds += [{"node": f"node {i}", "argv": ["ray", "start", "--address=HEAD_IP:6379"]} for i in range(1, nodes)]
            return cmds + [{"node": "head", "argv": serve}]
        return [{"node": "all", "argv": serve}]
    if kind == "sglang":
        base = ["python", "-m", "sglang.launch_server", "--model-path", "MODEL", "--tp", str(lay.tp * lay.pp),
                "--context-length", ctx, "--dtype", dtype]
        if lay.pp > 1:
            return [{"node": f"node {i}", "argv": base + ["--nnodes", str(lay.pp), "--node-rank", str(i),
                                                          "--dist-init-addr", "HEAD_IP:50000"]} for i in range(lay.pp)]
        return [{"node": "all", "argv": base}]
    if kind == "tensorrt-llm":
        pp = 2 if lay.name == "layer_split" else lay.pp
        return [{"node": "all", "argv": ["trtllm-serve", "MODEL", "--tp_size", str(lay.tp), "--pp_size", str(pp),
                                         "--max_seq_len", ctx]}]
    if kind == "llamacpp":
        argv = ["llama-server", "-m", "MODEL.gguf", "-ngl", "99", "-c", ctx]
        if lay.gpus_needed > 1 and lay.name != "replicas":
            argv += ["--split-mode", "layer"]
        if kv in ("q8_0", "q4_0"):
            argv += ["-fa", "on", "-ctk", kv, "-ctv", kv]
        return [{"node": "all", "argv": argv}]
    return []


def _bundled(model: Any, lay: Any, target: Any, dtype: str, k: int) -> list[dict[str, Any]]:
    """The bundled engine's serve line(s) (module docstring); [] for a layout it does not run."""
    if lay.name not in ("single", "replicas", "tp2"):
        return []
    base = ["python", "-m", "engine", "serve", "--model", "MODEL", "--max-context", str(target.context_tokens),
            "--dtype", dtype]
    if getattr(model, "kv_dtype", "") == "int8":
        base += ["--kv-cache-dtype", "int8"]
    if k and getattr(model, "draft_kind", "") == "mtp":
        base += ["--speculative", "mtp", "--draft-tokens", str(k)]
    if target.concurrency > 1:  # the sequences the plan priced (serve's own default is memory's, or 1 with MTP)
        base += ["--max-concurrency", str(target.concurrency)]
    if lay.name == "tp2":
        return [{"node": "all", "argv": base + ["--device", "cuda:0,cuda:1"]}]
    if lay.name == "single":
        return [{"node": "all", "argv": base + ["--device", "cuda:0,cuda:0"]}]
    return [{"node": f"replica {i}", "argv": base + ["--device", f"cuda:{i},cuda:{i}", "--port", str(_BASE_PORT["v100plan"] + i)]}
            for i in range(lay.streams)]
