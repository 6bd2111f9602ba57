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
"""

from __future__ import annotations

from typing import Any

_VLLM_KV = {"fp8": "fp8"}            # vLLM's --kv-cache-dtype takes auto or fp8 variants
_LLAMACPP_KV = {"q8_0": "q8_0", "q4_0": "q4_0", "fp16": "f16", "bf16": "bf16"}


def launch_commands(kind: str, model: Any, lay: Any, nodes: int, target: Any, dtype: str) -> list[dict[str, Any]]:
    """[{"node": "all" | "head" | "node i", "argv": [...]}] for ``kind``; [] when the engine has none."""
    ctx = str(target.context_tokens)
    kv = getattr(model, "kv_dtype", "")
    if kind == "vllm":
        serve = ["vllm", "serve", "MODEL", "--tensor-parallel-size", str(lay.tp), "--pipeline-parallel-size", str(lay.pp),
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
    if kind == "llamacpp":
        argv = ["llama-server", "-m", "MODEL.gguf", "-ngl", "99", "-c", ctx]
        if lay.gpus_needed > 1:
            argv += ["--split-mode", "layer"]
        if kv in ("q8_0", "q4_0"):
            argv += ["-fa", "on", "-ctk", kv, "-ctv", kv]
        return [{"node": "all", "argv": argv}]
    return []
