"""Every mistake a newcomer can make ends in `Error: ...`, a `Hint: ...` and a documented exit code.

One table: the input, a fragment of the message, a fragment of the hint, the exit code. One wording per
kind of mistake: the same mistake made through two commands reads the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import engine_helpers
from tests.engine_helpers import REPO
from v100plan.errors import EXIT_BAD_INPUT, EXIT_CODES, EXIT_ENVIRONMENT, EXIT_INTERRUPTED

demo_dir = engine_helpers.demo_dir
MODEL_JSON = "profiles/models/llama3.1-8b-fp16.json"
PROBE_JSON = "tests/fixtures/probes/h200-probe-quick.json"
NO_DIR = "/dev/null/x.json"  # a directory that cannot be created: its parent is a device file

# (argv, message fragment, hint fragment, exit code)
CLI_CASES = [
    (["plan", "--out", NO_DIR], "--out '/dev/null/x.json': directory '/dev/null' cannot be created",
     "writable directory", 2),
    (["plan", "--out", "{tmp}"], "is a directory, not a file", "writable directory", 2),
    (["compare", "h200x2", "--out", NO_DIR], "directory '/dev/null' cannot be created", "writable directory", 2),
    (["probe", "--from", PROBE_JSON, "--out", NO_DIR], "cannot be created", "writable directory", 2),
    (["plan", "--gpus", "0"], "--gpus must be at least 1, got 0", "e.g. --gpus 2", 2),
    (["plan", "--concurrency", "0"], "--concurrency must be at least 1, got 0", "e.g. --concurrency 2", 2),
    (["compare", "h200x0"], "the GPU count in 'h200x0' must be at least 1, got 0", "e.g. h200x2", 2),
    (["plan", "--objective", "speed"], "--objective must be one of latency, throughput, got 'speed'",
     "e.g. --objective latency", 2),
    (["compare", "h200x2", "--objective", "speed"], "--objective must be one of latency, throughput",
     "e.g. --objective latency", 2),
    (["plan", "--context", "-5"], "a token count must be positive, got '-5'", "whole number of tokens", 2),
    (["plan", "--context", "0"], "a token count must be positive, got '0'", "whole number of tokens", 2),
    (["plan", "--context", "lots"], "cannot read 'lots' as a token count", "whole number of tokens", 2),
    (["probe", "--from", MODEL_JSON], "expected a probe_report document, found kind 'model_profile'",
     "profiles validate", 2),
    (["plan", "--hardware", MODEL_JSON], "expected a probe_report or hardware_profile document, found kind "
     "'model_profile'", "profiles validate", 2),
    (["bench", "tp2", "--from", PROBE_JSON], "expected an engine_bench_tp2 document, found kind 'probe_report'",
     "python -m engine bench-tp2", 2),
    (["bench", "engine", "--from", MODEL_JSON], "expected an engine_bench document, found kind 'model_profile'",
     "python -m engine bench --out", 2),
    (["bench", "engine", "--shape", "gpt-9"], "unknown shape 'gpt-9'", "e.g. --shape llama-3.1-8b", 2),
    (["profiles", "show", "nope", "--json"], "unknown profile id 'nope'", "v100plan profiles list", 2),
    (["plan", "--engine", "no-such-engine"], "unknown engine id 'no-such-engine'", "v100plan profiles list", 2),
]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("argv, message, hint, code", CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_each_mistake_is_an_error_a_hint_and_its_code(cli, tmp_path, argv, message, hint, code):
    r = cli(*[a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = _flat(r.stderr)
    assert r.exit_code == code, (r.stdout, r.stderr)
    assert code in EXIT_CODES
    assert err.startswith("Error: "), r.stderr
    assert message in err, r.stderr
    assert "Hint: " in err and hint in err.split("Hint: ", 1)[1], r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "Usage:" not in r.stderr


def test_probe_refuses_a_bad_out_before_measuring(cli, monkeypatch):
    """A GPU host's run is never lost to a typo in --out: the path is refused before the probes start."""
    from v100plan import probe_run

    def measuring(*_a, **_k):
        raise AssertionError("the probes ran although --out cannot be written")

    monkeypatch.setattr(probe_run, "run", measuring)
    r = cli("probe", "--quick", "--out", NO_DIR)
    assert r.exit_code == EXIT_BAD_INPUT, r.stderr
    assert "cannot be created" in _flat(r.stderr)


def test_a_writable_out_still_gets_the_document(cli, tmp_path):
    out = tmp_path / "missing" / "plan.json"  # a missing directory is made, as qualify --out makes its own
    r = cli("plan", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    assert json.loads(out.read_text())["kind"] == "plan"


def test_user_text_is_not_read_as_markup(cli, tmp_path):
    """A schema pattern in a validation problem keeps its brackets; an error message keeps `[engine]`."""
    doc = json.loads((REPO / "profiles/hardware/h200.json").read_text())
    doc["id"] = "H200 SXM"
    bad = tmp_path / "bad[1].json"
    bad.write_text(json.dumps(doc))
    r = cli("profiles", "validate", str(bad))
    assert r.exit_code == EXIT_BAD_INPUT
    pattern = "'^[a-z0-9][a-z0-9.-]*$'"  # the schema's id pattern, as the problem quotes it
    assert pattern in _flat(r.stderr), r.stderr
    assert "bad[1].json" in _flat(r.stderr)
    assert "[a-z0-9]" in r.stdout, r.stdout


def test_error_output_escapes_brackets(capsys):
    from v100plan import output

    output.error("needs pip install 'v100plan[engine]'", "pattern '^[0-9]+$' [bold]x[/bold]")
    err = capsys.readouterr().err
    assert "v100plan[engine]" in err and "'^[0-9]+$'" in err and "[bold]x[/bold]" in err


def test_bench_engine_without_a_gpu_names_the_engine_extra(cli):
    r = cli("bench", "engine", "--quiet", "--contexts", "512")
    assert r.exit_code == EXIT_ENVIRONMENT, r.stderr
    assert "pip install 'v100plan[engine]'" in _flat(r.stderr)


def test_ctrl_c_in_a_command_is_quiet(cli, monkeypatch):
    from v100plan.commands import planning

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(planning, "plan_document", interrupted)
    r = cli("plan")
    assert r.exit_code == EXIT_INTERRUPTED
    assert _flat(r.stderr).startswith("Error: interrupted") and "Traceback" not in r.stderr


# python -m engine generate: (args after --model DIR, message fragment, exit code)
GENERATE_CASES = [
    (["--prompt", "hi", "--max-tokens", "4200"], "exceeds the context limit of 4096 tokens", 2),
    (["--prompt", "hi", "--max-tokens", "100000"], "exceeds the context limit of 4096 tokens", 2),
    (["--prompt", "hi", "--max-context", "9000"], "--max-context must be between 2 and the model's 4096", 2),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1", 2),
    (["--prompt", "hi", "--device", "gpu"], "--device must be cpu, cuda or cuda:N, got 'gpu'", 2),
]


def _generate(model, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message, code", GENERATE_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_generate_refuses_what_the_service_refuses(demo_dir, args, message, code):
    """Past the model's positions the model returns garbage: refused at once, as `serve` refuses it."""
    t0 = time.monotonic()
    r = _generate(demo_dir, *args)
    assert r.returncode == code, r.stderr
    assert r.stderr.startswith("Error: ") and message in r.stderr and "Hint: " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
    assert time.monotonic() - t0 < 60  # refused before any decoding (100000 tokens ran for 10+ minutes)


def test_generate_on_cuda_without_cuda_is_an_environment_error(demo_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the error cannot happen here")
    r = _generate(demo_dir, "--prompt", "hi", "--device", "cuda")
    assert r.returncode == EXIT_ENVIRONMENT, r.stderr
    assert r.stderr.startswith("Error: --device cuda: ") and "Hint: " in r.stderr and "Traceback" not in r.stderr


def test_generate_ctrl_c_is_quiet(demo_dir):
    """SIGINT during a long generation: exit 130 and one line, no KeyboardInterrupt traceback."""
    p = subprocess.Popen([sys.executable, "-m", "engine", "generate", "--model", str(demo_dir), "--prompt", "hi",
                          "--max-tokens", "4000"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    time.sleep(4)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == EXIT_INTERRUPTED, err
    assert err.strip() == "Error: interrupted", err


# The deploy extra hidden from the interpreter, as after the quick start's install (no fabric/paramiko).
_NO_DEPLOY_EXTRA = ("import sys\nfor m in ('paramiko', 'fabric', 'invoke'): sys.modules[m] = None\n"
                    "from v100plan.cli import main\nsys.argv = ['v100plan', *sys.argv[1:]]\nmain()")


@pytest.mark.parametrize("argv", [["deploy", "user@127.0.0.1", "--demo-model", "--dry-run"],
                                  ["status", "user@127.0.0.1"], ["probe", "--host", "user@127.0.0.1"]])
def test_a_missing_deploy_extra_names_the_pip_command_not_a_bug(argv):
    r = subprocess.run([sys.executable, "-c", _NO_DEPLOY_EXTRA, *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "V100PLAN_DEBUG": ""})
    assert r.returncode == EXIT_ENVIRONMENT, r.stderr
    assert "pip install 'v100plan[deploy]'" in r.stderr and "is not installed here" in r.stderr
    assert "this is a bug" not in r.stderr and "down" not in r.stderr and "Traceback" not in r.stderr


def test_a_broken_hf_config_is_not_sent_to_profiles_validate(cli, tmp_path):
    """`profiles validate` rejects every Hugging Face config, so it is no hint for a broken one."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    r = cli("plan", "--model", str(tmp_path))
    err = _flat(r.stderr)
    assert r.exit_code == EXIT_BAD_INPUT and "not readable JSON" in err, r.stderr
    hint = err.split("Hint: ", 1)[1]
    assert "config.json" in hint and "profiles validate` checks v100plan's own documents" in hint


def test_a_bad_deploy_host_hint_does_not_name_an_option_deploy_lacks(cli):
    r = cli("deploy", "us er@@h", "--demo-model", "--dry-run")
    err = _flat(r.stderr)
    assert r.exit_code == EXIT_BAD_INPUT and "is not user@host[:port]" in err, r.stderr
    assert "--host" not in err and "e.g. ubuntu@gpu-box" in err


def test_an_unreachable_endpoint_says_its_connect_error_once(cli, tmp_path):
    r = cli("accept", "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path))
    err = _flat(r.stderr)
    assert r.exit_code == EXIT_ENVIRONMENT, r.stderr
    assert err.count("ConnectError") == 1 and "could not be reached" in err, r.stderr
