"""Deploy the bundled engine to a host and manage it there: deploy, rollback, status, logs, stop.

On the host, under the remote root (docs/deploy.md):

    <deployment>/releases/<release-id>/   the bundle unpacked, manifest.json, model -> ../../../models/<digest>,
                                          venv -> ../../venvs/<venv-id>
    <deployment>/current -> releases/<id> switched atomically, only after /health and a smoke
                                          completion passed on the new release
    models/<digest>/                      the host's model store, shared by every deployment under the root:
                                          the model split here into tensor-parallel shards (shard.json,
                                          rank0/, rank1/), each file verified by SHA-256 after upload (in
                                          models/.partial/ until then) and again when another release links it;
                                          removed once no release links it
    <deployment>/run/                     the supervisor's state: supervisord.conf, pid, socket, logs
    <deployment>/api_key                  the service's API key (0600, made on the host, never printed)
    <deployment>/history.json             releases in the order they became current
    <deployment>/deploy.lock              held (flock) by the one deploy, rollback or stop at work

The service runs under the engine's own supervisor (`python -m engine supervise`), which
records the supervisord, proxy and rank PIDs and stops exactly those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from v100plan.errors import BadInput, ChecksFailed, EnvironmentProblem
from v100plan.remote import bluegreen as bg
from v100plan.remote import bundle as bundle_mod
from v100plan.remote import release as rel
from v100plan.remote import room
from v100plan.remote import split as split_mod
from v100plan.remote import venv as venv_mod
from v100plan.remote.connect import Remote
from v100plan.remote.host import agent, prepare, site_sentence
from v100plan.remote.manage import (  # noqa: F401 - one entry point
    follow_logs,
    key_rotate,
    key_show,
    logs,
    remove,
    rollback,
    status,
    stop,
)
from v100plan.remote.supervisor import (  # noqa: F401 - Target, DeployBusy, held_lock: one entry point
    DeployBusy,
    Outcome,
    Paths,
    Say,
    Target,
    healthy,
    held_lock,
    parse_json,
    session,
    settings_of,
)

# -- deploy ---------------------------------------------------------------------------------------

def deploy(target: Target, model_dir: str | Path, settings: rel.EngineSettings, *, dry_run: bool = False,
           health_timeout_s: float = 180.0, say: Say = lambda s: None, chose: str | None = None,
           purpose: str = "deploy", switch_mode: str = "auto", probe_sent: int = 0,
           origin: dict[str, Any] | None = None) -> Outcome:
    """``purpose`` other than "deploy" (qualify's own deployment) refuses a deployment that
    `v100plan deploy` made: qualify stops what it deploys, and must never stop a production service.
    ``probe_sent``: bytes the probe that chose the settings uploaded before (the bundle), counted as this
    deploy's bundle bytes. ``origin``: the plan the settings came from (kept in the manifest, shown by status)."""
    out = _deploy(target, model_dir, settings, dry_run, health_timeout_s, say, chose, purpose, switch_mode,
                  origin or {"chosen_by": settings.chosen_by})
    out.uploaded_bytes += probe_sent
    if "uploaded" in out.extra:
        out.extra["uploaded"]["bundle_bytes"] += probe_sent
    return out


def _deploy(target: Target, model_dir: str | Path, settings: rel.EngineSettings, dry_run: bool,
            health_timeout_s: float, say: Say, chose: str | None, purpose: str, switch_mode: str,
            origin: dict[str, Any]) -> Outcome:
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="deploy", chose=chose,
                  dry_run=dry_run)
    b = bundle_mod.build()
    rs = target.remote
    reqs = venv_mod.engine_requirements(rs.torch, rs.site_packages)
    vid = venv_mod.venv_id(rs.python, reqs, rs.index_url, rs.site_packages)
    source = rel.model_files(model_dir)
    # Split here, before anything goes over: the host gets each rank's own files. A dry run splits
    # nothing; it uses a split made before, if there is one, and otherwise says what it would split.
    sp = split_mod.cached(source) if dry_run else split_mod.split(model_dir, source)
    out.settings = settings.pinned()
    man, digest = None, None
    if sp is not None:
        if not dry_run:
            say(sp.sentence())
        man = rel.manifest(b.sha256, vid, reqs, settings, sp.files, {"tp": sp.tp, "source": sp.source_digest},
                           origin={**origin, "why": chose})
        out.release, digest = rel.release_id(man), man["model"]["digest"]
        out.extra["split"] = {"tp": sp.tp, "bytes_per_rank": sp.bytes_per_rank, "cached": sp.cached,
                              "files": len(sp.files), "seconds": round(sp.seconds, 2)}
    with session(target, out, bundle=b.id, venv=vid, model=digest, boot="1") as (remote, st, paths):
        out.previous = st.get("current")
        if purpose != "deploy" and any(h.get("why") == "deploy" for h in st.get("history", [])):
            raise BadInput(f"{remote.label}: deployment {target.deployment!r} was made by `v100plan deploy`; "
                           f"{purpose} deploys under a name of its own and stops it afterwards",
                           hint=f"give {purpose} another --deployment name (its default is {purpose!r})")
        if rs.site_packages and st.get("venv"):
            _site_report(out, rs, st.get("venv_from_site"), say if not dry_run else None)
        if dry_run:
            # The exact command the supervisor will run; what only the host decides is a placeholder.
            out.extra["serve_command"] = rel.serve_command(settings, paths.release(out.release or "<RELEASE>"),
                                                           paths.key)
            say(f"would serve: {' '.join(out.extra['serve_command'])}")
            _plan_actions(remote, target.remote, paths, st, b, vid, reqs, Path(model_dir), source, sp, digest,
                          out.release, settings, out, switch_mode)
            for a in out.actions:
                say(f"would: {a}")
            return out
        with held_lock(remote, target.remote, paths.lock, f"{purpose} of {out.release}"):
            _deploy_locked(remote, target, paths, st, b, reqs, sp.dir, sp.files, man, out.release, settings,
                           health_timeout_s, say, out, purpose, switch_mode)
        return out


def _plan_actions(remote, rs, paths, st, b, vid, reqs, model_dir, source, sp, digest, rid, settings,
                  out, switch_mode="auto") -> None:
    acts = out.actions
    if sp is None:
        w = split_mod.weight_bytes(source)
        acts.append(f"split {model_dir} locally into {split_mod.TP} tensor-parallel shards (python -m engine shard "
                    f"--tp {split_mod.TP}: {w / 1e6:.1f} MB of weights, about {w / 2e6:.1f} MB per rank plus the "
                    f"replicated tensors), check they reassemble bit-exactly, cache them in "
                    f"{split_mod.cache_dir(rel.model_digest(source))}; the release id is the hash of a manifest "
                    "that lists the shards' SHA-256, so it is known once they are made")
    else:
        acts.append(f"reuse the local split {sp.dir}: {sp.tp} shards, "
                    f"{', '.join(f'{x / 1e6:.1f}' for x in sp.bytes_per_rank)} MB per rank (nothing to split)")
    if rid is not None and st.get("current") == rid:
        if healthy(remote, rs, paths, st, rid, settings.port, dry_run=True):
            acts.append(f"nothing: release {rid} is current and healthy (0 bytes to upload, no restart)")
            return
        out.changed = True
        acts.append(f"start release {rid} again: it is current but its service is down")
        return
    out.changed = True  # a dry run: what the deploy would change
    acts.append(f"reuse bundle {b.id}" if st["bundle_tar"] else
                f"upload the bundle ({b.size / 1e3:.0f} kB) to {paths.root}/bundles/{b.id}.tar.gz")
    if not rs.site_packages:
        acts.append(f"reuse venv {vid}" if st["venv"] else
                    f"build venv {paths.root}/venvs/{vid} with {' '.join(reqs)}")
    elif st["venv"]:
        acts.append(f"reuse venv {vid}, which sees {rs.python}'s site packages; from there: "
                    f"{site_sentence(st.get('venv_from_site'))}")
    else:
        chk = agent(remote, rs, "site_check", {"requirements": reqs})  # read-only
        _site_report(out, rs, chk["from_site"], None, to_install=chk["to_install"])
        todo = chk["to_install"]
        acts.append(f"build venv {paths.root}/venvs/{vid} with `{rs.python} -m venv --system-site-packages`: it "
                    f"sees the packages of {chk['python']}'s site ({', '.join(chk['site_dirs']) or 'none found'}); "
                    f"from there: {site_sentence(chk['from_site'])}; "
                    + (f"pip installs {' '.join(todo)}" if todo else "nothing to install (no package index needed)"))
    if sp is None:
        acts.append(f"upload the shards (shard.json, rank0/, rank1/) to the host's model store {paths.models}/<their "
                    "digest> unless it holds them, and verify each file's SHA-256 there")
    elif st.get("model"):
        acts.append(f"reuse model {digest} from the host's model store {paths.models} (shared by its deployments; "
                    "each file's SHA-256 checked there before the release links it: nothing to upload)")
    else:
        total = sum(f["bytes"] for f in sp.files.values())
        acts.append(f"upload {len(sp.files)} shard file(s) (shard.json, rank0/, rank1/), {total / 1e6:.1f} MB, "
                    f"to {paths.model_partial(digest)}, verify each SHA-256 there, then store them as "
                    f"{paths.model(digest)}")
    if not st.get("api_key"):
        acts.append(f"create the API key file {paths.key} (0600, made on the host)")
    rid_text = rid or "<id>"
    acts.append(f"unpack release {rid_text} into {paths.dir}/releases/{rid_text}, its model -> the shards")
    rid = rid_text
    cfg = json.loads((model_dir / "config.json").read_text())
    sw = room.decide(remote, switch_mode, settings, cfg, sp.bytes_per_rank if sp else None, st.get("current"))
    out.extra["switch"] = sw.to_dict()
    mode, mode_why = sw.mode, sw.why
    if st.get("current"):
        acts.append(f"switch {mode}: {mode_why}")
    front = st.get("front")
    if not front or front.get("port") != settings.port:
        acts.append(f"start the front on 127.0.0.1:{settings.port} (it forwards to the release in service)")
    if st.get("current") and mode == "stop-start":
        acts.append(f"stop the service of release {st['current']} first ({mode_why})")
    acts.append(f"start release {rid} under supervisord in a slot of {paths.run} on a free port ({settings.device})"
                + (f", beside release {st['current']}, which keeps serving" if st.get("current") and
                   mode == "blue-green" else "") + "; wait for /health, send one smoke completion")
    acts.append(f"switch the front to release {rid}, then {paths.dir}/current -> releases/{rid}" +
                (f"; stop release {st['current']} (kept for rollback)" if st.get("current") and mode == "blue-green"
                 else ""))
    if st.get("current"):
        acts.append(f"if a check fails: stop {rid}" + (f"; release {st['current']} keeps serving" if mode ==
                                                        "blue-green" else f" and start {st['current']} again"))


def _upload_model(remote: Remote, target: Target, paths: Paths, model_dir: Path, files: dict, digest: str,
                  say: Say, has_rsync: bool, mdir: str | None = None) -> None:
    """Shard files (shard.json, rank0/, rank1/) the host lacks (or holds with another SHA-256) into ``mdir``
    (default: this deployment's partial upload of the store entry): rsync over ssh when both ends have
    rsync, SFTP otherwise; both resume a broken upload. Then every file's SHA-256 is checked there, and
    only then is the directory marked verified (and so can become, or stay, a store entry)."""
    mdir = mdir or paths.model_partial(digest)
    subdirs = sorted({str(Path(f).parent) for f in files if str(Path(f).parent) != "."})
    agent(remote, target.remote, "mkdirs", {"paths": [mdir, *(f"{mdir}/{s}" for s in subdirs)]})
    held = agent(remote, target.remote, "sha256", {"dir": mdir})
    have = held["files"]
    todo = [f for f in files if have.get(f) != files[f]["sha256"]]
    # A file as long as ours (or longer) with another SHA-256 is damaged, not half-sent: resuming would
    # skip or append to it, so it goes first. A shorter one is where a broken upload stopped.
    damaged = [f for f in todo if f in have and held.get("bytes", {}).get(f, 0) >= files[f]["bytes"]]
    if damaged:
        say(f"removing {len(damaged)} damaged file(s) on the host to send them anew: {', '.join(damaged)}")
        agent(remote, target.remote, "unlink", {"dir": mdir, "files": damaged})
    total = sum(files[f]["bytes"] for f in todo)
    # a file a broken upload left shorter is resumed where it stopped: only the rest goes over
    there = sum(min(held.get("bytes", {}).get(f, 0), files[f]["bytes"]) for f in todo if f not in damaged)
    _check_room(remote, target, mdir, total - there)
    use_rsync = bool(todo) and has_rsync and remote.rsync_command() is not None
    say(f"uploading {len(todo)} shard file(s), {(total - there) / 1e6:.1f} MB "
        + (f"to send ({there / 1e6:.1f} MB of {total / 1e6:.1f} MB already there, resumed) " if there else "")
        + f"({'rsync over ssh' if use_rsync else 'SFTP'}, resumable)")
    if use_rsync:
        remote.rsync(model_dir, mdir, todo)
    else:
        for f in todo:
            remote.upload(model_dir / f, f"{mdir}/{f}")
    got = agent(remote, target.remote, "sha256", {"dir": mdir})["files"]
    bad = [f for f in files if got.get(f) != files[f]["sha256"]]
    if bad:
        raise EnvironmentProblem(f"{remote.label}: shard file(s) {', '.join(bad)} in {mdir} do not match their "
                                 "SHA-256 after upload", hint="run the deploy again (it resumes and re-checks)")
    agent(remote, target.remote, "verified", {"dir": mdir})


def _check_stored(remote: Remote, target: Target, paths: Paths, model_dir: Path, files: dict, digest: str,
                  say: Say, has_rsync: bool) -> None:
    """The store holds an entry of this digest (perhaps another deployment's upload): its files are checked
    by SHA-256 against this release's manifest before the release links it, never trusted by name. A file
    that differs (a damaged disk, a hand edit) is sent anew in place."""
    mdir = paths.model(digest)
    got = agent(remote, target.remote, "sha256", {"dir": mdir})["files"]
    bad = sorted(f for f in files if got.get(f) != files[f]["sha256"])
    if not bad:
        say(f"reusing model {digest} from the host's model store ({len(files)} shard file(s), each SHA-256 checked "
            "there): nothing to upload for the model")
        return
    say(f"the host's model store entry {mdir} has {len(bad)} file(s) whose SHA-256 differs from this release's "
        f"manifest ({', '.join(bad[:3])}): sending them anew")
    _upload_model(remote, target, paths, model_dir, files, digest, say, has_rsync, mdir=mdir)


def _check_room(remote: Remote, target: Target, where: str, needed: int) -> None:
    """Refuse an upload the host's disk cannot hold (checked before sending, not found out half-way)."""
    if needed <= 0:
        return
    doc = agent(remote, target.remote, "free_bytes", {"path": where})
    margin = max(16 << 20, needed // 50)  # the rest of the release (manifest, logs) and the filesystem's own
    if doc["free_bytes"] < needed + margin:
        raise EnvironmentProblem(
            f"{remote.label}: {needed / 1e6:.1f} MB of shards to upload, but only {doc['free_bytes'] / 1e6:.1f} MB "
            f"are free on the filesystem of {doc['path']}; nothing was sent",
            hint=f"free some space there (old venvs under {target.remote.root}/venvs, releases of other "
                 "deployments), or deploy with another --remote-root")


def _deploy_locked(remote, target, paths, st, b, reqs, model_dir, files, man, rid, settings, health_timeout_s,
                   say, out, purpose, switch_mode="auto") -> None:
    current = st.get("current")
    uploaded = out.extra["uploaded"] = {"bundle_bytes": 0, "model_bytes": 0}  # what went over, by part
    fresh = purpose != "deploy"  # qualify: every run starts the service anew, on empty logs
    if fresh:
        sw = room.Switch("stop-start", "a fresh run", [])
    elif current == rid:  # nothing new to fit beside it: the release is current (serving, or to start again)
        sw = room.choose(switch_mode, settings, None, "the release is current", None, None, remote.label)
    else:
        cfg = json.loads((Path(model_dir) / "rank0" / "config.json").read_text())
        sw = room.decide(remote, switch_mode, settings, cfg, out.extra["split"]["bytes_per_rank"], current)
        if current and sw.mode == "blue-green" and sw.gpus:
            say(f"switch blue-green: {sw.why}")
    out.extra["switch"] = sw.to_dict()
    mode, mode_why = sw.mode, sw.why
    old_settings = settings_of(st.get("current_manifest"))
    if current == rid:
        if not fresh and healthy(remote, target.remote, paths, st, rid, settings.port):
            out.reason = "nothing changed"
            out.extra["after_reboot"] = st.get("boot")
            say(f"nothing changed: release {rid} is current and healthy; uploaded 0 bytes, restarted nothing")
            return
        say(f"release {rid} is current: starting it afresh" if fresh else
            f"release {rid} is current but not serving: starting it")
        ok, why = bg.bring_up(remote, target.remote, paths, st, rid, settings, health_timeout_s, say, purpose,
                              mode=mode, old_settings=old_settings, record=out.extra, drain_timeout_s=target.drain_timeout_s,
                              keep=target.keep_releases)
        out.restarted = True
        if not ok:
            raise ChecksFailed(f"{remote.label}: release {rid} did not come back: {why}",
                               hint=f"`v100plan logs {remote.label}` shows the service's logs")
        return
    sent_before = remote.bytes_sent
    prep = prepare(remote, target.remote, reqs, stage=say, bundle=b, unpack=False)
    if target.remote.site_packages and "site_packages" not in out.extra:  # the venv is new (or just made)
        _site_report(out, target.remote, prep.from_site, None if prep.created_venv else say)
    uploaded["bundle_bytes"] = remote.bytes_sent - sent_before
    digest = man["model"]["digest"]
    partial = None
    if st.get("model"):
        _check_stored(remote, target, paths, Path(model_dir), files, digest, say, has_rsync=bool(st.get("rsync")))
    else:
        partial = paths.model_partial(digest)
        _upload_model(remote, target, paths, Path(model_dir), files, digest, say, has_rsync=bool(st.get("rsync")))
    uploaded["model_bytes"] = remote.bytes_sent - sent_before - uploaded["bundle_bytes"]
    agent(remote, target.remote, "keygen", {"path": paths.key})
    agent(remote, target.remote, "mkdirs", {"paths": [f"{paths.dir}/releases", paths.run]})
    agent(remote, target.remote, "extract", {
        "tar": prep.bundle_tar, "dest": paths.release(rid), "manifest": man, "links": {"venv": prep.venv_dir},
        "store": {"models": paths.models, "digest": digest, "partial": partial}})
    if settings.device != "cpu":
        _check_stack(remote, paths, rid, out.extra.get("site_packages"))
    out.changed = True
    say(f"starting release {rid} ({settings.device}, serving 127.0.0.1:{settings.port}) "
        + (f"beside release {current}, which serves until {rid} passes /health and a smoke completion"
           if current and mode == "blue-green" else f"({mode_why})" if current else "")
        + "; waiting for /health")
    out.restarted = True
    ok, why = bg.bring_up(remote, target.remote, paths, st, rid, settings, health_timeout_s, say, purpose,
                          mode=mode, old_settings=old_settings, record=out.extra, drain_timeout_s=target.drain_timeout_s,
                              keep=target.keep_releases)
    if ok:
        say(f"release {rid} is current" + (f" (previous {current} kept, stopped)" if current else ""))
        return
    out.reason = why
    agent(remote, target.remote, "discard", {"dep": paths.dir, "release": rid})
    if current:
        out.rolled_back = mode == "stop-start"
        kept = ("was started again" if mode == "stop-start" else "kept serving throughout")
        raise ChecksFailed(f"{remote.label}: release {rid} failed its checks; release {current} {kept}: {why}",
                           hint=f"`v100plan logs {remote.label} --release {rid}` shows the failed start")
    raise ChecksFailed(f"{remote.label}: release {rid} failed its checks (no previous release to fall back to): "
                       f"{why}", hint=f"`v100plan logs {remote.label} --release {rid}` shows the failed start")


def _site_report(out: Outcome, rs, from_site: list[dict] | None, say: Say | None,
                 to_install: list[str] | None = None) -> None:
    """The deploy's record (JSON ``site_packages``) of what its venv takes from the host's site."""
    out.extra["site_packages"] = {"python": rs.python, "from_site": from_site or []}
    if to_install is not None:
        out.extra["site_packages"]["to_install"] = to_install
    if say is not None:
        say(f"the venv sees {rs.python}'s site packages; taken from there: {site_sentence(from_site)}")


def torch_gap(report: dict[str, Any], host: str, site: dict[str, Any] | None = None) -> EnvironmentProblem | None:
    """The error to stop a deploy with when the venv's torch has no kernels for a card (the probe's
    software_stack verdict, per card), else None. ``site``: the deploy's ``site_packages`` record, when
    the venv sees the host's site; a torch taken from there is named with its path, and the fix differs."""
    bad = [c for c in report.get("cards") or [] if c.get("torch_supported") is False]
    if not bad:
        return None
    info = report.get("host") or {}
    ccs = sorted({c.get("compute_capability") for c in bad if c.get("compute_capability")})
    sms = ", ".join("sm_" + cc.replace(".", "") for cc in ccs)
    archs = ", ".join(info.get("torch_arch_list") or [])
    fix = ("--index-url https://download.pytorch.org/whl/cu126 --torch 'torch==<a version built for cu126>'")
    site_torch = next((p for p in (site or {}).get("from_site") or [] if p.get("name") == "torch"), None)
    if site_torch is not None:
        return EnvironmentProblem(
            f"{host}: torch {info.get('torch_version')} from the host's site ({site_torch['path']}, seen through "
            f"--remote-site-packages from {site.get('python')}) has no kernels for {sms} (its arch list: {archs}); "
            "the new release was not started",
            hint="the host's own torch does not cover this card; a V100 (sm_70) needs a CUDA 12.x build (CUDA 13 "
                 f"builds dropped sm_70): deploy with {fix} (pip installs it into the venv, in front of the site's; "
                 "the host must reach that index), or name an interpreter whose torch covers the card with "
                 "--remote-python")
    return EnvironmentProblem(
        f"{host}: torch {info.get('torch_version')} in the host's venv has no kernels for {sms} "
        f"(its arch list: {archs}); the new release was not started",
        hint=f"a V100 (sm_70) needs a CUDA 12.x torch build (CUDA 13 builds dropped sm_70): deploy with {fix}")


def _check_stack(remote: Remote, paths: Paths, rid: str, site: dict[str, Any] | None = None) -> None:
    """On GPUs: the probe's software_stack verdict, run with the release's own venv (and so with the
    host's site torch when the venv sees the site), decides."""
    rdir = paths.release(rid)
    r = remote.run([f"{rdir}/venv/bin/python", "-m", "probes", "--only", "inventory,software_stack"],
                   cwd=rdir, check=False, what="python -m probes --only software_stack")
    problem = torch_gap(parse_json(r.stdout), remote.label, site)
    if problem is not None:
        raise problem


# -- the deploy's table ------------------------------------------------------------------------------

def _uploaded(out: Outcome) -> str:
    """All bytes sent, and of them the bundle's (engine, probes, profiles) and the model's shards."""
    parts = out.extra.get("uploaded")
    if not parts:
        return str(out.uploaded_bytes)
    return f"{out.uploaded_bytes} (bundle {parts['bundle_bytes']}, model {parts['model_bytes']})"


def deploy_rows(out: Outcome) -> list[tuple[str, object]]:
    """The deploy command's table: what was deployed, split, uploaded and switched."""
    rows = [("host", out.host), ("deployment", out.deployment), ("release", out.release),
            ("previous", out.previous), ("changed", out.changed), ("restarted", out.restarted),
            ("uploaded bytes", _uploaded(out)), ("wall s", f"{out.wall_s:.1f}")]
    sp = out.extra.get("split")
    if sp:
        rows.insert(4, ("split", f"{sp['tp']} shards, {' + '.join(f'{b / 1e6:.1f}' for b in sp['bytes_per_rank'])}"
                                 f" MB" + (" (cached here)" if sp["cached"] else f" (split now, {sp['seconds']} s)")))
    site = out.extra.get("site_packages")
    if site is not None:
        taken = ", ".join(f"{p['name']} {p['version']}" for p in site.get("from_site") or []) or "nothing"
        rows.append(("from the host's site", f"{taken} ({site['python']})"))
    sw = out.extra.get("switch")
    if out.reason == "nothing changed":  # no release starts: no switch to describe
        rows.append(("switch", "none: the current release serves on"))
    elif sw:
        rows.append(("switch", f"{sw['mode']}: {sw['why']}"))
    if "after_reboot" in out.extra:
        rows.append(("after a reboot", out.extra["after_reboot"] or "nothing brings it back"))
    if out.dry_run:
        if out.settings is not None:
            n = out.settings.get("max_concurrency")
            rows.append(("max concurrency", n if n is not None else "the engine's default (/health will say it)"))
        if out.extra.get("serve_command"):
            rows.append(("serve command", " ".join(out.extra["serve_command"])))
        rows.append(("actions", len(out.actions)))
    elif out.reason:
        rows.append(("note", out.reason))
    return rows
