"""Work on one host that every remote command shares: the agent, the bundle, the venvs.

Layout under the remote root (default ~/.v100plan; docs/deploy.md draws it whole):

    bundles/<bundle-id>.tar.gz     the probes + engine bundle as uploaded (kept: releases unpack it)
    bundles/<bundle-id>/           unpacked, for `python -m probes`
    venvs/<venv-id>/               one venv per dependency set (.v100plan-complete once built)
    <deployment>/...               see v100plan.remote.deploy
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from v100plan.remote import bundle as bundle_mod
from v100plan.remote import venv as venv_mod
from v100plan.remote.connect import Remote
from v100plan.remote.errors import RemoteFailed

# The agent as sent: the trusted-folder rules first (one helper on both sides), then the agent itself.
AGENT_SOURCE = "\n".join((Path(__file__).resolve().parent / name).read_text() for name in ("trusted.py", "agent.py"))
DEFAULT_ROOT = "~/.v100plan"
VENV_TIMEOUT_S = 1800.0  # a torch wheel over a slow link


@dataclass(frozen=True)
class RemoteSettings:
    root: str = DEFAULT_ROOT          # on the host; ~ is the remote user's home
    python: str = "python3"           # the host's interpreter that builds venvs and runs the agent
    index_url: str | None = None      # an extra package index for the venv (a CUDA 12.x torch build)
    torch: str | None = None          # the torch requirement (default: the version this machine runs)
    site_packages: bool = False       # venvs see the interpreter's site (--remote-site-packages): a torch
                                      # the host already has is used, not installed again


def site_sentence(from_site: list[dict] | None) -> str:
    """``torch 2.5.1, numpy 1.26.4 (in /usr/lib/python3/dist-packages)``, grouped by site directory
    (``; `` between directories), or ``nothing``."""
    by_path: dict[str, list[str]] = {}
    for p in from_site or []:
        by_path.setdefault(p["path"], []).append(f"{p['name']} {p['version']}")
    return "; ".join(f"{', '.join(names)} (in {path})" for path, names in by_path.items()) or "nothing"


def sh_path(path: str) -> str:
    """A remote path for a shell command line: ``~/x`` becomes ``"$HOME"/'x'``, the rest is quoted."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def agent(remote: Remote, settings: RemoteSettings, action: str, args: dict, *,
          timeout_s: float | None = -1, check: bool = True) -> dict:
    """Run one agent action on the host; its one JSON line, parsed."""
    r = remote.run([settings.python, "-c", AGENT_SOURCE, action, json.dumps(args)], timeout_s=timeout_s,
                   what=f"v100plan agent {action}", check=False)
    lines = r.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        doc = None
    if doc is not None and doc.get("untrusted"):
        raise RemoteFailed(f"{remote.label}: {doc['untrusted']}",
                           hint="if you did not make it, another user of the host may have: look there (ls -la), "
                                "remove it, or name a folder of your own with --remote-root")
    if doc is None or (check and r.exit_code != 0):
        detail = (r.stderr.strip() or r.stdout.strip())[-800:]
        if r.exit_code == 127 or "not found" in detail and not lines:
            raise RemoteFailed(f"{remote.label}: {settings.python!r} is not there ({detail})",
                               hint="install python3 (3.10 or newer) on the host, or name it with --remote-python")
        raise RemoteFailed(f"{remote.label}: agent {action} failed (exit {r.exit_code}): {detail}",
                           hint=f"run again with V100PLAN_DEBUG=1; check the host's disk and {settings.root}")
    return doc


@dataclass
class Prepared:
    root: str                 # absolute, on the host
    bundle_id: str
    bundle_dir: str
    bundle_tar: str
    venv_dir: str
    uploaded_bytes: int
    created_venv: bool
    from_site: list[dict] | None = None   # site mode: what the venv takes from the host's site


def prepare(remote: Remote, settings: RemoteSettings, requirements: list[str],
            stage: Callable[[str], None] = lambda s: None, bundle: bundle_mod.Bundle | None = None,
            unpack: bool = True) -> Prepared:
    """Make sure the host holds the bundle (uploaded only if absent) and a venv with ``requirements``."""
    b = bundle or bundle_mod.build()
    vid = venv_mod.venv_id(settings.python, requirements, settings.index_url, settings.site_packages)
    st = agent(remote, settings, "state", {"root": settings.root, "bundle": b.id, "venv": vid})
    root = st["root"]
    sent = 0
    tar = f"{root}/bundles/{b.id}.tar.gz"
    if not st["bundle_tar"]:
        stage(f"uploading the bundle ({b.size / 1e3:.0f} kB)")
        agent(remote, settings, "mkdirs", {"paths": [f"{root}/bundles", f"{root}/venvs"]})
        sftp = remote.sftp()
        part = tar + ".part"
        with sftp.open(part, "wb") as fh:
            fh.chmod(0o600)
            fh.set_pipelined(True)
            fh.write(b.data)
        sftp.posix_rename(part, tar)
        remote.bytes_sent += b.size
        sent += b.size
    if unpack and not st["bundle"]:
        agent(remote, settings, "extract", {"tar": tar, "dest": f"{root}/bundles/{b.id}"})
    created = False
    from_site = st.get("venv_from_site")
    if not st["venv"]:
        names = ", ".join(r.split("==")[0] for r in requirements)
        stage(f"building the venv ({names})" if not settings.site_packages else
              f"building the venv with {settings.python}'s site packages ({names}: what the site has is not "
              "installed again)")
        v = agent(remote, settings, "venv", {"dir": f"{root}/venvs/{vid}", "requirements": requirements,
                                             "index_url": settings.index_url,
                                             "system_site_packages": settings.site_packages},
                  timeout_s=max(VENV_TIMEOUT_S, remote.options.command_timeout_s), check=False)
        if v.get("error", "").startswith("`"):
            raise RemoteFailed(f"{remote.label}: {v['error']}", hint="install the venv module there, or name "
                               "another interpreter with --remote-python")
        if v.get("lost"):
            raise RemoteFailed(f"{remote.label}: {v['error']}", hint="check the interpreter's site with "
                               f"`{settings.python} -m site` there, or name another one with --remote-python")
        if v.get("error") and settings.site_packages:
            has = ", ".join(f"{n} {ver}" if ver else f"no {n}" for n, ver in (v.get("site_has") or {}).items())
            raise RemoteFailed(
                f"{remote.label}: the site of {settings.python} does not hold {', '.join(v.get('to_install') or [])}"
                f" (it has {has or 'none of them'}) and pip could not install "
                f"{'it' if len(v.get('to_install') or []) == 1 else 'them'}: {v['error']}",
                hint="with --remote-site-packages, what the host's site lacks comes from a package index: install "
                     "it into that site, name the interpreter that has it with --remote-python, or give the host an "
                     "index (pip config there, or --index-url)"
                     + ("; without --torch any torch the site has will do" if settings.torch and any(
                         re.split(r"[<>=!~;\[ ]", r)[0] == "torch" for r in v.get("to_install") or []) else ""))
        if v.get("error"):
            raise RemoteFailed(f"{remote.label}: pip could not install {', '.join(requirements)}: {v['error']}",
                               hint="the host needs a package index it can reach (pip config there), "
                                    "or --index-url for a CUDA 12.x torch build (or --remote-site-packages "
                                    "when the host's python already has torch)")
        created = bool(v.get("created"))
        from_site = v.get("from_site")
        if settings.site_packages:
            stage(f"taken from the host's site: {site_sentence(from_site)}; installed into the venv: "
                  f"{', '.join(v.get('installed') or []) or 'nothing'}")
    return Prepared(root=root, bundle_id=b.id, bundle_dir=f"{root}/bundles/{b.id}", bundle_tar=tar,
                    venv_dir=f"{root}/venvs/{vid}", uploaded_bytes=sent, created_venv=created,
                    from_site=from_site if settings.site_packages else None)
