"""An OpenAI-compatible server of another make, for tests that must hold for any such server.

`independent_server` (session scope) runs Hugging Face's `transformers serve` as a real subprocess
on 127.0.0.1, serving the demo model from a local directory, with no network: the model is written
by this test session (engine.core.demo), and the hub is switched off (HF_HUB_OFFLINE=1). Nothing of
this project's engine runs inside it: transformers tokenizes, templates, generates and streams.

Why this server: it ships in the `transformers[serving]` extra (pure Python, installs in seconds
on top of the torch CI already has), serves /v1/completions and /v1/chat/completions with SSE
streaming, and loads a local model directory. llama-cpp-python's server has an API key and is
closer to OpenAI's wire format, but PyPI has only its source and the build takes minutes of both
cores (see docs/independent-server.md, with every measured figure and the capability list).

What transformers 5.25's server does differently from OpenAI is listed in `LACKS` below, and
tests/engine/test_independent_server.py checks every entry, so a release that closes a gap fails that
test and the list is brought up to date.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0  # model load plus uvicorn start: about 5 s idle, more when the 2 cores are busy
STOP_TIMEOUT_S = 15.0

# What `transformers serve` needs besides transformers itself: transformers.utils.import_utils.
# is_serve_available() (pydantic, fastapi, uvicorn, openai), and accelerate for its device_map load.
REQUIRED_MODULES = ("transformers", "torch", "fastapi", "uvicorn", "openai", "pydantic", "accelerate")

# Gaps against the OpenAI API that an acceptance case must treat as "not applicable" for this make.
# Each is demonstrated by tests/engine/test_independent_server.py::test_documented_gaps.
LACKS: dict[str, str] = {
    "api_key": "no API-key option: every request is served, whatever Authorization header it carries",
    "done_marker": "streams end with the finish_reason chunk and the connection closing; no 'data: [DONE]'",
    "stop_excluded": "with `stop`, the returned text keeps the matched stop string (and the rest of the"
                     " token that holds it); finish_reason is \"stop\" as it should be",
    "temperature_sampling": "temperature alone does not switch sampling on (the model's generation config"
                            " decides); seed and temperature act only with generation_config"
                            " '{\"do_sample\": true}'",
    "token_id_prompt": "/v1/completions takes a string prompt only; a list of token ids is a 400",
    "n": "n > 1 is ignored: one choice comes back",
    "error_object": "errors are FastAPI's {\"detail\": ...}, not OpenAI's {\"error\": {\"message\": ...}}",
    "unknown_field_400": "an unknown request field is a 422 (FastAPI's validation status), OpenAI says 400;"
                         " vLLM's extensions such as ignore_eos are unknown fields too",
}


@dataclass(frozen=True)
class IndependentServer:
    """A running server: where it listens and what to send it."""

    url: str  # base URL, e.g. http://127.0.0.1:PORT (the API is under /v1)
    model: str  # the `model` value requests must carry (the server is pinned to this one model)
    api_key: str | None  # None: this make has no API-key option
    make: str  # server software and version, e.g. "transformers-serve 5.25.0"
    model_dir: Path
    log_path: Path
    pid: int
    lacks: dict[str, str] = field(default_factory=dict)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def missing_modules() -> list[str]:
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def make_version() -> str:
    return f"transformers-serve {importlib.metadata.version('transformers')}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(out: Path) -> Path:
    """The demo model, packaged the way hub Llama models are, so that transformers reads it as the
    engine does: tokenizer.json gets a BOS post-processor (transformers ignores tokenizer_config's
    add_bos_token for a plain fast tokenizer) and the chat template starts with {{ bos_token }}.
    The engine's tokenizer still gives the same ids for this copy (it adds BOS itself, once)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from engine.core import demo

    demo.make(out)
    cfg = json.loads((out / "config.json").read_text())
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    bos, bos_id = tcfg["bos_token"], cfg["bos_token_id"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    if tok.token_to_id(bos) != bos_id:
        raise RuntimeError(f"demo tokenizer maps {bos!r} to {tok.token_to_id(bos)}, config says {bos_id}")
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    tok.save(str(out / "tokenizer.json"))
    tcfg["chat_template"] = "{{ bos_token }}" + tcfg["chat_template"]
    tcfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
    return out


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the test process dies, even by SIGKILL, so a
    killed test run leaves no server holding a port and a core (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (uvicorn shuts down cleanly), SIGKILL after STOP_TIMEOUT_S."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:  # anything left in the group (the server itself past its grace period, or a child)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start(workdir: Path, timeout_s: float = START_TIMEOUT_S) -> tuple[IndependentServer, subprocess.Popen]:
    """Write the model, start `transformers serve` on a free 127.0.0.1 port, wait until it answers.

    Ready means /v1/models lists this model directory, so a stranger that took the port between
    free_port() and the server's bind is never mistaken for it; a lost port race is retried
    (twice) on a new port. Raises RuntimeError with the log's tail when the server exits or is
    not ready in time."""
    model_dir = write_model(workdir / "model")
    for attempt in range(3):
        log_path = workdir / f"server-{attempt}.log"
        proc, url = _launch(model_dir, workdir, log_path, free_port())
        try:
            if _wait_ready(proc, url, str(model_dir), log_path, timeout_s):
                break
        except BaseException:
            _stop(proc)
            raise
    else:
        raise RuntimeError(f"transformers serve lost the race for a free port 3 times:\n{_tail(log_path)}")
    server = IndependentServer(url=url, model=str(model_dir), api_key=None, make=make_version(),
                               model_dir=model_dir, log_path=log_path, pid=proc.pid, lacks=dict(LACKS))
    return server, proc


def _launch(model_dir: Path, workdir: Path, log_path: Path, port: int) -> tuple[subprocess.Popen, str]:
    # Without --continuous-batching: requests queue one behind another, but stop strings and seeded
    # sampling work; with it on CPU, both were ignored (docs/independent-server.md).
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--log-level", "warning"]
    # No network: the hub is off (no model download, no update check, no telemetry) and HF_HOME is private.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(workdir / "hf-home"),
           "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "TOKENIZERS_PARALLELISM": "false",
           # One torch thread: a 3 M-parameter model gains nothing from two, and two spinning OpenMP
           # threads on 2 busy cores made each request 10-20x slower (docs/independent-server.md).
           "OMP_NUM_THREADS": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return proc, f"http://127.0.0.1:{port}"


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-3000:]


def _wait_ready(proc: subprocess.Popen, url: str, model: str, log_path: Path, timeout_s: float) -> bool:
    """True once the server lists `model`; False when it exited because its port was taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            if "address already in use" in log_path.read_text(errors="replace").lower():
                return False
            raise RuntimeError(f"transformers serve exited with {proc.returncode} before it was ready:\n"
                               + _tail(log_path))
        try:
            r = httpx.get(f"{url}/v1/models", timeout=2)
            if r.status_code == 200 and model in [m.get("id") for m in r.json().get("data", [])]:
                return True
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"transformers serve not ready on {url} after {timeout_s:.0f} s:\n" + _tail(log_path))
        time.sleep(0.2)


@pytest.fixture(scope="session")
def independent_server(tmp_path_factory):
    """`transformers serve` on the demo model, on 127.0.0.1; stopped (with its process group) at the end."""
    missing = missing_modules()
    if missing:
        pytest.skip(f"the independent OpenAI-compatible server needs {', '.join(missing)}: "
                    "pip install -e '.[dev]' installs them (transformers[serving])")
    if importlib.util.find_spec("transformers.cli.serving.completion") is None:
        pytest.fail(f"{make_version()} has no /v1/completions; pyproject's dev extra asks for transformers>=5.25")
    server, proc = start(tmp_path_factory.mktemp("independent-server"))
    try:
        yield server
    finally:
        _stop(proc)
