"""The bundled engine started on this machine for `qualify`: under its real supervisor
(`python -m engine supervise`), with an API key in a 0600 file, fault injection on, on a free
loopback port. Stopping it stops every process it started, and its logs are copied next to the
report so nothing is lost."""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from v100plan.errors import EnvironmentProblem


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_demo_model(path: Path, arch: str = "llama", mtp: bool = False) -> Path:
    """The engine's generated demo model of ``arch`` (deterministic; reused when already there); ``mtp``:
    with its MTP draft layer (qwen3_5 only), for `serve --speculative mtp`."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    proc = subprocess.run([sys.executable, "-m", "engine", "make-demo-model", str(path), "--arch", arch,
                           *(["--mtp"] if mtp else [])], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise EnvironmentProblem(f"could not write the demo model: {proc.stderr.strip()[-400:]}",
                                 "the engine needs torch, numpy, safetensors and tokenizers: "
                                 "pip install 'v100plan[engine,serve]'")
    return path


def has_mtp_layer(model_dir: Path) -> bool:
    """Whether the model's config.json declares an MTP draft layer (what `serve --speculative mtp` needs)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("text_config", cfg).get("mtp_num_hidden_layers"))


def state_dir_readers(state_dir: Path):
    """(read_rank_logs, read_service_log) for an engine state directory on this machine."""

    def rank_logs() -> dict[int, str]:
        out = {}
        for rank in (0, 1):
            files = glob.glob(str(Path(state_dir) / "logs" / f"rank{rank}.g*.log"))
            files.sort(key=lambda p: int(re.search(r"\.g(\d+)\.log$", p).group(1)))
            out[rank] = "".join(Path(p).read_text(errors="replace") for p in files)
        return out

    def service_log() -> str:
        # Where serve writes it by default (or --log-file as deploy sets it); else what the supervisor
        # or a wrapper captured of its stderr, where every structured line also goes.
        for name in ("service.log", "logs/serve.stderr.log", "logs/serve.stdout.log", "serve.log"):
            try:
                text = (Path(state_dir) / name).read_text(errors="replace")
            except OSError:
                continue
            if text:
                return text
        return ""

    return rank_logs, service_log


class LocalService:
    def __init__(self, model_dir: Path, *, devices: str = "cpu", dtype: str = "float32", allreduce: str = "auto",
                 max_context: int | None = None, serve_flags: list[str] | None = None):
        # Unix socket paths must stay short (108 bytes): the state lives under a short private /tmp dir.
        self.state_dir = Path(tempfile.mkdtemp(prefix="v1p-q-"))
        os.chmod(self.state_dir, 0o700)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.api_key = secrets.token_urlsafe(24)
        key_file = self.state_dir / "api-key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.api_key + "\n")
        self.model_dir = model_dir
        self.flags = ["--model", str(model_dir), "--tp", "2", "--host", "127.0.0.1", "--port", str(self.port),
                      "--api-key-file", str(key_file), "--device", devices, "--dtype", dtype,
                      "--allreduce", allreduce, "--enable-fault-injection", *(serve_flags or [])]
        if max_context is not None:
            self.flags += ["--max-context", str(max_context)]
        self.started = False

    def _supervise(self, *args: str, timeout_s: float) -> dict:
        proc = subprocess.run([sys.executable, "-m", "engine", "supervise", *args], capture_output=True, text=True,
                              timeout=timeout_s)
        try:
            out = json.loads(proc.stdout) if proc.stdout.strip() else {}
        except json.JSONDecodeError:
            out = {}
        if proc.returncode != 0:
            tail = self.log_tail()
            raise EnvironmentProblem(
                f"the engine did not start under its supervisor (exit {proc.returncode}): "
                f"{(proc.stderr.strip() or proc.stdout.strip())[-400:]}" + (f"\nservice log:\n{tail}" if tail else ""),
                "run `python -m engine serve --model DIR` by hand to see why; the engine needs "
                "pip install 'v100plan[engine,serve]'")
        return out

    def start(self, wait_s: float = 300) -> dict:
        self.started = True
        return self._supervise("start", "--state-dir", str(self.state_dir), "--wait-healthy-s", str(wait_s),
                               "--", *self.flags, timeout_s=wait_s + 60)

    def stop(self) -> dict:
        if not self.started:
            return {}
        self.started = False
        return self._supervise("stop", "--state-dir", str(self.state_dir), timeout_s=90)

    def health(self) -> dict:
        """/health as the key holder sees it (details such as the allreduce path need the key)."""
        import httpx

        try:
            r = httpx.get(self.endpoint + "/health", headers={"Authorization": f"Bearer {self.api_key}"}, timeout=5)
            return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        except (httpx.HTTPError, ValueError):
            return {}

    # ----- logs ----------------------------------------------------------------------------------
    def read_service_log(self) -> str:
        return state_dir_readers(self.state_dir)[1]()

    def log_tail(self, n: int = 15) -> str:
        lines = self.read_service_log().splitlines()
        err = self.state_dir / "logs" / "serve.stderr.log"
        if err.exists():
            lines += err.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def read_rank_logs(self) -> dict[int, str]:
        return state_dir_readers(self.state_dir)[0]()

    def keep_logs(self, dest: Path) -> Path:
        """Copy the service's and ranks' logs next to the report (the API key file stays behind)."""
        dest.mkdir(parents=True, exist_ok=True)
        for src in [self.state_dir / "service.log", *sorted((self.state_dir / "logs").glob("*.log"))]:
            if src.exists():
                shutil.copy2(src, dest / src.name)
        return dest

    def remove(self) -> None:
        shutil.rmtree(self.state_dir, ignore_errors=True)
