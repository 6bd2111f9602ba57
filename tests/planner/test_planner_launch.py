"""--nodes and --gpus beyond two: TP up to 8 in a box, pipeline stages across boxes, and the launch commands.

Their commands are checked against the flags their documentation gives (`vllm serve
--tensor-parallel-size --pipeline-parallel-size --distributed-executor-backend ray` after `ray start`;
`python -m sglang.launch_server --tp --nnodes --node-rank --dist-init-addr`) and, where the packages are
importable, against vLLM's and SGLang's own argument parsers. Both install on a CPU-only machine without
their dependencies (tests/test_planner_launch.requirements.txt: vllm 0.33.0, sglang 0.5.23 and the light
modules their parsers import). Without them the parser tests skip; with V100PLAN_REQUIRE_ENGINE_PARSERS=1
they fail instead, so a CI that installed the parsers cannot pass by skipping them.
"""

from __future__ import annotations

import importlib
import os

import pytest

from v100plan import plan_inputs

LLAMA70 = "profiles/published/configs/llama-3-70b.config.json"
TWO_BOXES = ["plan", "--hardware", "v100-sxm2-32gb", "--gpus", "8", "--nodes", "2", "--model", LLAMA70,
             "--weights", "fp32", "--context", "8K"]


def _flags(argv):
    """--flag value pairs (and --flag=value) of an argv list."""
    out, i = {}, 0
    while i < len(argv):
        w = argv[i]
        if w.startswith("--") and "=" in w:
            k, v = w.split("=", 1)
            out[k] = v
        elif w.startswith("--"):
            out[w] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
        i += 1
    return out


def test_two_boxes_of_eight_need_the_pipeline_and_vllm_commands(cli):
    doc = cli.json(*TWO_BOXES, "--engine", "vllm")
    names = {s["name"]: s for s in doc["strategies"]}
    assert {"tp4", "tp8", "tp8_pp2"} <= set(names)
    assert not names["tp8"]["fits"] and names["tp8_pp2"]["fits"]           # 282 GB of fp32 weights need both boxes
    L = doc["launch"]
    assert L["strategy"] == "tp8_pp2"
    cmds = L["commands"]
    assert cmds[0]["argv"] == ["ray", "start", "--head", "--port=6379"]
    assert cmds[1]["argv"][:3] == ["ray", "start", "--address=HEAD_IP:6379"]
    serve = cmds[-1]["argv"]
    assert serve[:3] == ["vllm", "serve", "MODEL"]
    f = _flags(serve)
    assert f["--tensor-parallel-size"] == "8" and f["--pipeline-parallel-size"] == "2"
    assert f["--distributed-executor-backend"] == "ray" and f["--max-model-len"] == str(8 * 1024)


def test_two_boxes_of_eight_sglang_commands_one_per_node(cli):
    doc = cli.json(*TWO_BOXES, "--engine", "sglang")
    cmds = doc["launch"]["commands"]
    assert [c["node"] for c in cmds] == ["node 0", "node 1"]
    for rank, c in enumerate(cmds):
        assert c["argv"][:3] == ["python", "-m", "sglang.launch_server"]
        f = _flags(c["argv"])
        assert f["--tp"] == "16" and f["--nnodes"] == "2" and f["--node-rank"] == str(rank)
        assert f["--dist-init-addr"] == "HEAD_IP:50000"


def test_engines_without_multi_node_refuse_the_pipeline(cli):
    r = cli(*TWO_BOXES, "--engine", "llamacpp", "--json")
    import json

    doc = json.loads(r.stdout)
    s = next(x for x in doc["strategies"] if x["name"] == "tp1_pp2" or x["name"].endswith("_pp2"))
    assert not s["fits"] and "does not run across nodes" in s["reason"]


def test_llamacpp_quantized_kv_cache_flags(cli):
    doc = cli.json("plan", "--hardware", "rtx4090-24g", "--gpus", "1", "--model", "engine/data/qwen3-8b.config.json",
                   "--weights", "q4_k_m", "--engine", "llamacpp", "--kv-cache-dtype", "q4_0", "--context", "32K")
    argv = doc["launch"]["commands"][0]["argv"]
    assert argv[:2] == ["llama-server", "-m"] and _flags(argv) == {}  # llama.cpp uses short flags here
    assert argv[argv.index("-ctk") + 1] == "q4_0" and argv[argv.index("-ctv") + 1] == "q4_0"
    assert doc["strategies"][0]["decode_tok_s"] is not None               # Ada is calibrated for llama.cpp


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_exit_code_one_when_nothing_fits(cli, engine):
    r = cli("plan", "--hardware", "v100-pcie-16gb", "--gpus", "1", "--model", LLAMA70, "--weights", "fp32",
            "--engine", engine, "--context", "8K")
    assert r.exit_code == 1
    assert "Nearest configuration that fits" in r.stdout or "No strategy fits" in r.stdout


# -- the engines' own argument parsers (vLLM and SGLang install on CPU with --no-deps and a few light deps;
#    skipped where they are not installed, and then the documented-flag tests above are what ran) --------------

def _launch(cli, engine):
    return cli.json(*TWO_BOXES, "--engine", engine)["launch"]["commands"]


def _engine_package(name: str):
    """The engine's package; skipped when it is not installed, unless V100PLAN_REQUIRE_ENGINE_PARSERS=1."""
    if os.environ.get("V100PLAN_REQUIRE_ENGINE_PARSERS") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def test_vllm_serve_parser_accepts_the_command(cli, monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")           # parse on a machine without a GPU
    _engine_package("vllm")
    import argparse

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = _launch(cli, "vllm")[-1]["argv"]
    assert serve[:2] == ["vllm", "serve"]
    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(sub)
    args = top.parse_args(serve[1:])
    assert isinstance(args, argparse.Namespace)
    assert args.model_tag == "MODEL" and args.tensor_parallel_size == 8 and args.pipeline_parallel_size == 2
    assert args.distributed_executor_backend == "ray" and args.max_model_len == 8 * 1024


def test_sglang_parser_accepts_every_node_command(cli):
    _engine_package("sglang")
    import argparse

    from sglang.srt.server_args import ServerArgs

    for rank, c in enumerate(_launch(cli, "sglang")):
        assert c["argv"][:3] == ["python", "-m", "sglang.launch_server"]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(c["argv"][3:])
        assert args.tp_size == 16 and args.nnodes == 2 and args.node_rank == rank
        assert args.dist_init_addr == "HEAD_IP:50000"


def test_pipeline_hand_overs_priced_from_the_network_entry(cli, tmp_path):
    """A hardware profile with a 'network' entry prices the hand-over between pipeline stages: latency plus
    hidden x 2 bytes / bandwidth. The numbers below are round test inputs for the arithmetic, not a NIC's facts."""
    import json

    from v100plan import catalogue

    doc = json.loads(json.dumps(catalogue.get("hardware", "v100-sxm2-32gb")))
    doc["id"] = "v100-sxm2-32gb-test-net"
    doc["network"] = {"kind": "infiniband", "bw_gbps": 10.0, "latency_us": 100.0}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    args = list(TWO_BOXES)
    args[args.index("v100-sxm2-32gb")] = str(path)
    plan = cli.json(*args, "--engine", "vllm")
    s = next(x for x in plan["strategies"] if x["name"] == "tp8_pp2")
    assert s["fits"]
    assert not any("no network figures" in n for n in plan["notes"])
    # one hand-over per round: 100 us + 8192 x 2 bytes / 10 GB/s = 101.6 us
    assert s["breakdown"]["decode"]["hops_ms"] == pytest.approx(0.1016, abs=1e-3)


# -- launch commands are the strategy's, the dtype the file's, the default engine the card's ----------------------

LLAMA8 = "profiles/published/configs/llama-3-8b.config.json"


@pytest.mark.parametrize("engine, weights, program, port", [("vllm", "fp16", "vllm", 8000), ("llamacpp", "q4_k_m", "llama-server", 8080)])
def test_replicas_get_one_command_per_card_on_its_own_gpu_and_port(cli, engine, weights, program, port):
    doc = cli.json("plan", "--hardware", "h100-sxm", "--gpus", "2", "--model", LLAMA8, "--weights", weights,
                   "--engine", engine, "--context", "8K", "--objective", "throughput")
    L = doc["launch"]
    assert L["strategy"] == "replicas" and L["replicas"] == 2
    cmds = L["commands"]
    assert [c["node"] for c in cmds] == ["replica 0", "replica 1"]
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in cmds] == ["0", "1"]
    assert [_flags(c["argv"])["--port"] for c in cmds] == [str(port), str(port + 1)]
    for c in cmds:
        assert c["argv"][0] == program and "--split-mode" not in c["argv"]
        assert _flags(c["argv"]).get("--tensor-parallel-size", "1") == "1" and _flags(c["argv"]).get("--tp", "1") == "1"
    assert any(n.startswith("launch (replica 1): CUDA_VISIBLE_DEVICES=1 ") for n in doc["notes"])


def test_layer_split_on_vllm_is_its_pipeline_parallel(cli):
    from v100plan import catalogue
    from v100plan.planner import Target, hardware_from_doc
    from v100plan.planner.launch import launch_commands
    from v100plan.planner.strategies import layout

    m, _ = plan_inputs.load_model(LLAMA8, "fp16", None)
    lay = layout("layer_split", m, 2)
    argv = launch_commands("vllm", m, lay, 1, Target(context_tokens=8192, gpus=2), "float16")[0]["argv"]
    assert _flags(argv)["--pipeline-parallel-size"] == "2" and _flags(argv)["--tensor-parallel-size"] == "1"
    assert plan_inputs.engine("vllm") and hardware_from_doc(catalogue.get("hardware", "h100-sxm"), 2)


@pytest.mark.parametrize("model, weights, hardware, dtype", [
    ("llama3.1-8b-fp16", None, "h100-sxm", "float16"),           # an fp16 file is served in fp16, not the card's bf16
    (LLAMA8, "bf16", "h100-sxm", "bfloat16"),
    (LLAMA8, "int4-awq", "h100-sxm", "float16"),                  # AWQ/GPTQ kernels take fp16 activations
    (LLAMA8, "bf16", "v100-sxm2-32gb", "float16"),                # no native bf16 on Volta
])
def test_launch_dtype_is_the_weights_own(cli, model, weights, hardware, dtype):
    args = ["plan", "--hardware", hardware, "--gpus", "2", "--model", model, "--engine", "vllm", "--context", "8K"]
    doc = cli.json(*args, *(["--weights", weights] if weights else []))
    assert doc["launch"]["dtype"] == dtype
    assert _flags(doc["launch"]["commands"][0]["argv"])["--dtype"] == dtype


@pytest.mark.parametrize("hardware", ["h200", "v100-sxm2-32gb", "rtx3090", "tesla-p40"])
def test_the_default_engine_is_the_bundled_one_the_user_can_launch(cli, hardware):
    """Issue 43: an engine that is not bundled is never the default recommendation; the bundled one has its line."""
    doc = cli.json("plan", "--hardware", hardware, "--gpus", "2", "--context", "8K")
    assert doc["launch"]["engine"] == "v100plan" and doc["launch"]["bundled"] is True
    assert doc["launch"]["commands"][0]["argv"][:4] == ["python", "-m", "engine", "serve"]


def test_bench_planner_json_is_a_document():
    from v100plan import documents
    from v100plan import plan_accuracy as accuracy

    doc = accuracy.document(accuracy.evaluate(accuracy.PUBLISHED.parent.parent.parent), accuracy.PUBLISHED, None)
    documents.validate(doc, "planner_accuracy")
    assert doc["kind"] == "planner_accuracy" and doc["schema_version"] and doc["provenance"]["tool"] == "v100plan"
    assert doc["summary"]["goal"] == {"median_abs_error": 0.05, "worst_abs_error": 0.15}
