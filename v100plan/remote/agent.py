"""The helper v100plan runs on a host: ``python3 -c <this file> ACTION JSON-ARGS``.

Stdlib only (it runs before any venv exists); every action prints one JSON object on
stdout. It is sent as the command's source, never stored on the host, so a read-only
action (``state``, ``sha256``) leaves the host's files untouched (what --dry-run needs).
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request

try:  # imported as a module (tests); sent to a host, trusted.py's source comes before this file's
    from v100plan.remote.trusted import Untrusted, check_private, private_dir
except ImportError:
    pass


def _out(doc):
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _link_target(path):
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _read_json(path, default):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def _write_json(path, doc):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, path)


def state(a):
    """What is already on the host: bundle, venv, the deployment's releases. Read-only. A root (or a
    folder above it) another user could have made or could change is refused (Untrusted)."""
    root = os.path.expanduser(a["root"])
    if os.path.lexists(root):
        check_private(root, "remote root")
    out = {"root": root, "python": sys.version.split()[0], "rsync": shutil.which("rsync") is not None,
           "home": os.path.expanduser("~")}
    if a.get("bundle"):
        out["bundle"] = os.path.isdir(os.path.join(root, "bundles", a["bundle"]))
        out["bundle_tar"] = os.path.isfile(os.path.join(root, "bundles", a["bundle"] + ".tar.gz"))
    if a.get("venv"):
        out["venv"] = os.path.isfile(os.path.join(root, "venvs", a["venv"], ".v100plan-complete"))
        if out["venv"]:
            out["venv_from_site"] = _site_now(os.path.join(root, "venvs", a["venv"]))
    if a.get("dep"):
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
        out["deployments"] = [n for n in names if os.path.isdir(os.path.join(root, n, "releases"))]
        d = os.path.join(root, a["dep"])
        rel = os.path.join(d, "releases")
        out["exists"] = os.path.isdir(d)
        out["current"] = _link_target(os.path.join(d, "current"))
        out["releases"] = sorted(os.listdir(rel)) if os.path.isdir(rel) else []
        out["history"] = _read_json(os.path.join(d, "history.json"), [])
        out["api_key"] = os.path.isfile(os.path.join(d, "api_key"))
        run = os.path.join(d, "run")
        # the live slot (its release's upstream port behind the front), the front, and a service an
        # earlier v100plan started in run/ itself (before the front and slots)
        out["live"] = _read_json(os.path.join(run, "upstream.json"), None)
        out["front"] = _front_now(run)
        out["front_processes"] = _front_record(run)
        if out["live"] and out["live"].get("slot"):
            out["ranks_alive"] = _ranks_alive(os.path.join(run, out["live"]["slot"]))
        out["legacy"] = _alive(_read_int(os.path.join(run, "supervisord.pid")))
        out["slots"] = {s: _alive(_read_int(os.path.join(run, s, "supervisord.pid"))) for s in ("a", "b")}
        out["lock"] = _lock_holder(os.path.join(d, "deploy.lock"))
        if a.get("site") or a.get("boot"):  # status, deploy: how the deployment comes back after a reboot
            out["boot"] = _boot_now(run)
        if a.get("model"):  # the host's model store, shared by every deployment under the root
            out["model"] = os.path.isfile(os.path.join(root, "models", a["model"], ".v100plan-verified"))
        if out["current"]:
            out["current_manifest"] = _read_json(os.path.join(rel, out["current"], "manifest.json"), None)
            vid = (out["current_manifest"] or {}).get("venv_id")
            if a.get("site") and vid:  # status: what the current release's venv takes from the host's site
                out["current_venv_from_site"] = _site_now(os.path.join(root, "venvs", vid))
    _out(out)


def _site_now(d):
    """For a venv that sees the host's site: what it takes from there now (the site may have changed since
    the venv was built; the record of the build stands in if the venv cannot be asked). Else None."""
    deps = _read_json(os.path.join(d, ".v100plan-deps.json"), {})
    if not deps.get("system_site_packages"):
        return None
    try:
        return _venv_view(d, deps["requirements"])[1]
    except (SystemExit, OSError, ValueError, subprocess.SubprocessError):
        return deps.get("from_site")


def mkdirs(a):
    for p in a["paths"]:
        private_dir(p)
    _out({"ok": True})


# -- the model store: <root>/models/<digest>/, shared by every deployment of the root -------------

def _store_lock(models, how):
    """Hold models/.lock: shared while a release is linked to an entry, exclusive while unlinked entries
    are removed, so an entry is never removed between its check and its link."""
    models = os.path.expanduser(models)
    os.makedirs(models, mode=0o700, exist_ok=True)
    fh = open(os.path.join(models, ".lock"), "a")
    fcntl.flock(fh, how)
    return fh


def _store_entry(s):
    """The store entry ``digest``; a verified upload in ``partial`` (hidden: never an entry) is renamed
    into place first. An entry exists only once all its files matched their SHA-256 (`verified`)."""
    models = os.path.expanduser(s["models"])
    entry = os.path.join(models, s["digest"])
    part = s.get("partial") and os.path.expanduser(s["partial"])
    if part and os.path.isfile(os.path.join(part, ".v100plan-verified")):
        if os.path.isfile(os.path.join(entry, ".v100plan-verified")):
            shutil.rmtree(part, ignore_errors=True)  # another deployment stored the same files meanwhile
        else:
            shutil.rmtree(entry, ignore_errors=True)  # never verified: not an entry
            os.rename(part, entry)
    if not os.path.isfile(os.path.join(entry, ".v100plan-verified")):
        raise SystemExit("the model store entry %s is missing or unverified (removed meanwhile?): deploy again"
                         % entry)
    return entry


def _linked_entries(root):
    """The store entries some release of some deployment under ``root`` links to."""
    used = set()
    for dep in os.listdir(root) if os.path.isdir(root) else []:
        rel_dir = os.path.join(root, dep, "releases")
        if dep == "models" or not os.path.isdir(rel_dir):
            continue
        for r in os.listdir(rel_dir):
            link = os.path.join(rel_dir, r, "model")
            if os.path.islink(link):
                used.add(os.path.realpath(link))
    return used


def _gc_models(root):
    """Remove the store entries no release links any more (their deployments' releases pruned or removed)."""
    models = os.path.join(root, "models")
    if not os.path.isdir(models):
        return []
    removed = []
    with _store_lock(models, fcntl.LOCK_EX):
        used = _linked_entries(root)
        for name in sorted(os.listdir(models)):
            p = os.path.join(models, name)
            if not name.startswith(".") and os.path.isdir(p) and os.path.realpath(p) not in used:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(name)
    return removed


def extract(a):
    """Unpack a bundle tar into ``dest`` (through a temporary directory, so it appears whole or not at all)."""
    dest = os.path.expanduser(a["dest"])
    if os.path.isdir(dest) and not a.get("replace"):
        _out({"extracted": False})
        return
    tmp = "%s.tmp-%d" % (dest, os.getpid())
    os.makedirs(tmp)
    with tarfile.open(os.path.expanduser(a["tar"])) as tar:
        for m in tar.getmembers():
            if m.name.startswith("/") or ".." in m.name.split("/") or not (m.isfile() or m.isdir()):
                raise SystemExit("refusing tar member %r" % m.name)
        tar.extractall(tmp)
    for name in a.get("links", {}):
        os.symlink(a["links"][name], os.path.join(tmp, name))
    if a.get("store"):  # the release's model: an entry of the host's store, linked while the store is held
        with _store_lock(a["store"]["models"], fcntl.LOCK_SH):
            entry = _store_entry(a["store"])
            os.symlink(os.path.relpath(entry, os.path.abspath(dest)), os.path.join(tmp, "model"))
    if a.get("manifest") is not None:
        _write_json(os.path.join(tmp, "manifest.json"), a["manifest"])
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    _out({"extracted": True})


# Run by a given interpreter (the host's, or a venv's): which distribution each name resolves to there,
# the one `import` would find first. Stdlib only.
_SEEN = r"""
import json, sys
from importlib import metadata
out = {}
for name in json.loads(sys.argv[1]):
    try:
        d = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        out[name] = None
    else:
        out[name] = {"version": d.version, "path": str(d.locate_file("")).rstrip("/")}
print(json.dumps(out))
"""


def _req_name(req):
    """``(name, specifier)`` of a requirement line such as ``torch==2.5.1`` or ``numpy``."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$", req)
    return (m.group(1), m.group(2).strip()) if m else (req, "")


def _satisfies(version, spec):
    """Does an installed ``version`` meet ``spec``: none (any version will do) or one exact ``==`` pin (a
    local label such as +cu126 is ignored unless the pin names one). Any other specifier: pip decides."""
    if not spec:
        return True
    if spec.startswith("==") and not any(c in spec for c in ",*;"):
        want = spec[2:].strip()
        return version == want or ("+" not in want and version.split("+")[0] == want)
    return False


def _seen(python, names):
    r = subprocess.run([python, "-B", "-c", _SEEN, json.dumps(names)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit("%s could not read its packages' metadata: %s" % (python, r.stderr.strip()[-500:]))
    return json.loads(r.stdout.strip().splitlines()[-1])


def _from_site(python, requirements):
    """Which ``requirements`` the site of ``python`` already satisfies ([{requirement, name, version, path}])
    and which are left to install."""
    names = [_req_name(r)[0] for r in requirements]
    seen = _seen(python, names)
    taken, todo = [], []
    for req, name in zip(requirements, names):
        d = seen.get(name)
        if d and _satisfies(d["version"], _req_name(req)[1]):
            taken.append({"requirement": req, "name": name, "version": d["version"], "path": d["path"]})
        else:
            todo.append({"requirement": req, "name": name, "site_version": d and d["version"]})
    return taken, todo


def _site_dirs():
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(user):
        dirs.append(user)
    return dirs


def site_check(a):
    """What the site of this interpreter holds of ``requirements``: what a venv made with
    --system-site-packages would take from there, and what pip would have to install. Read-only."""
    taken, todo = _from_site(sys.executable, a["requirements"])
    _out({"python": sys.executable, "site_dirs": _site_dirs(), "from_site": taken,
          "to_install": [t["requirement"] for t in todo], "site_has": {t["name"]: t["site_version"] for t in todo}})


def _link_site(d):
    """A venv made by an interpreter that is itself a venv (a host's /opt/torch/.venv/bin/python) sees the
    base installation's site, not that venv's: a .pth file adds the interpreter's own site directories,
    after the new venv's (so what pip installs into the new venv comes first)."""
    if sys.prefix == getattr(sys, "base_prefix", sys.prefix):
        return None
    py = os.path.join(d, "bin", "python")
    r = subprocess.run([py, "-B", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    purelib = r.stdout.strip()
    if r.returncode != 0 or not os.path.isdir(purelib):
        raise SystemExit("the new venv %s has no site-packages directory: %s" % (d, r.stderr.strip()[-300:]))
    pth = os.path.join(purelib, "_v100plan_site.pth")
    with open(pth, "w") as fh:
        fh.write("".join(p + "\n" for p in site.getsitepackages() if os.path.isdir(p)))
    return pth


def _venv_view(d, requirements):
    """What the venv ``d`` resolves each requirement to, and of those the ones outside the venv: taken from
    the host's site ([{requirement, name, version, path}])."""
    names = [_req_name(r)[0] for r in requirements]
    seen = _seen(os.path.join(d, "bin", "python"), names)
    inside = os.path.realpath(d) + os.sep
    return seen, [{"requirement": r, "name": n, "version": seen[n]["version"], "path": seen[n]["path"]}
                  for r, n in zip(requirements, names)
                  if seen.get(n) and not os.path.realpath(seen[n]["path"]).startswith(inside)]


def venv(a):
    """Create the venv ``dir`` with ``requirements`` unless a complete one is there (one creator at a time).

    ``system_site_packages``: the venv sees this interpreter's site (``venv --system-site-packages``, plus a
    .pth file when the interpreter is itself a venv); a requirement the site already satisfies is not
    installed again, and what was taken from there (name, version, path) is recorded and reported."""
    d = os.path.expanduser(a["dir"])
    os.makedirs(os.path.dirname(d), mode=0o700, exist_ok=True)
    marker = os.path.join(d, ".v100plan-complete")
    with open(d + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(marker):
            _out({"created": False, "dir": d})
            return
        if os.path.isdir(d):
            shutil.rmtree(d)  # a half-built venv from a run that broke off
        t0 = time.monotonic()
        use_site = bool(a.get("system_site_packages"))
        taken, missing = _from_site(sys.executable, a["requirements"]) if use_site else ([], [])
        todo = [t["requirement"] for t in missing] if use_site else a["requirements"]
        # of what must be installed, the versions the site does have (None: not there at all)
        site_has = {t["name"]: t["site_version"] for t in missing}
        cmd = [sys.executable, "-m", "venv", d]
        if use_site:
            # nothing left to install: no pip in the venv either (no ensurepip needed, none of pip's time)
            cmd[3:3] = ["--system-site-packages"] + ([] if todo else ["--without-pip"])
        made = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if made.returncode != 0:
            shutil.rmtree(d, ignore_errors=True)
            _out({"created": False, "error": "`%s -m venv` failed (on Debian/Ubuntu: apt-get install python3-venv): %s"
                  % (sys.executable, made.stderr.strip()[-800:])})
            sys.exit(3)
        site_link = _link_site(d) if use_site else None
        if todo:
            pip = [os.path.join(d, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            if a.get("index_url"):
                pip += ["--extra-index-url", a["index_url"]]
            proc = subprocess.run(pip + todo, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                shutil.rmtree(d, ignore_errors=True)
                _out({"created": False, "error": proc.stderr.strip()[-1500:], "from_site": taken, "to_install": todo,
                      "site_has": site_has})
                sys.exit(3)
        deps = {"requirements": a["requirements"], "index_url": a.get("index_url")}
        if use_site:
            seen, from_site = _venv_view(d, a["requirements"])
            lost = [t["name"] for t in taken if not seen.get(t["name"])]
            if lost:
                shutil.rmtree(d, ignore_errors=True)
                _out({"created": False, "lost": lost, "error": "a venv made with --system-site-packages does not "
                      "see %s of %s's site" % (", ".join(lost), sys.executable), "from_site": taken,
                      "to_install": todo})
                sys.exit(3)
            deps.update({"system_site_packages": True, "site_dirs": _site_dirs(), "site_link": site_link,
                         "installed": todo, "from_site": from_site})
        _write_json(os.path.join(d, ".v100plan-deps.json"), deps)
        open(marker, "w").close()
        _out({"created": True, "dir": d, "seconds": round(time.monotonic() - t0, 1),
              "from_site": deps.get("from_site"), "installed": todo})


def sha256(a):
    """{relative path: SHA-256} (and their sizes) of every file under ``dir`` except v100plan's markers.
    Read-only."""
    d = os.path.expanduser(a["dir"])
    out, sizes = {}, {}
    for base, dirs, files in os.walk(d):
        dirs.sort()
        for f in sorted(files):
            if f.startswith(".v100plan-") or f.endswith(".part"):
                continue
            p = os.path.join(base, f)
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            out[os.path.relpath(p, d)] = h.hexdigest()
            sizes[os.path.relpath(p, d)] = os.path.getsize(p)
    _out({"files": out, "bytes": sizes})


def unlink(a):
    """Remove the named files under ``dir`` (uploaded files whose SHA-256 is wrong, so they are sent anew)."""
    d = os.path.realpath(os.path.expanduser(a["dir"]))
    removed = []
    for rel in a["files"]:
        p = os.path.realpath(os.path.join(d, rel))
        if not p.startswith(d + os.sep):
            raise SystemExit("refusing to remove %r: not under %s" % (rel, d))
        if os.path.isfile(p):
            os.unlink(p)
            removed.append(rel)
    _out({"removed": removed})


def verified(a):
    """Mark a model directory as checked (its files matched the local SHA-256s); its files are made 0600 and
    its folders 0700, as the shards were made (whatever the upload's umask gave them)."""
    d = os.path.expanduser(a["dir"])
    for base, dirs, files in os.walk(d):
        os.chmod(base, 0o700)
        for f in files:
            os.chmod(os.path.join(base, f), 0o600)
    os.close(os.open(os.path.join(d, ".v100plan-verified"), os.O_WRONLY | os.O_CREAT, 0o600))
    _out({"ok": True})


def lock(a):
    """Hold the deployment's lock until our stdin closes (the SSH channel ends, however it ends)."""
    path = os.path.expanduser(a["path"])
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        with open(path) as fh:
            holder = fh.read().strip()
        _out({"locked": False, "holder": holder})
        return
    os.ftruncate(fd, 0)
    os.write(fd, (a["info"] + " pid %d" % os.getpid()).encode())
    _out({"locked": True})
    sys.stdin.read()


def switch(a):
    """Point ``current`` at the release atomically (a new link renamed over the old) and record it."""
    d = os.path.expanduser(a["dep"])
    rel = a["release"]
    tmp = os.path.join(d, "current.tmp-%d" % os.getpid())
    os.symlink(os.path.join("releases", rel), tmp)
    os.replace(tmp, os.path.join(d, "current"))
    hist = [h for h in _read_json(os.path.join(d, "history.json"), []) if h.get("release") != rel]
    entry = {"release": rel, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "why": a.get("why")}
    if a.get("from"):
        entry["from"] = a["from"]  # a rollback: the release it left (the next rollback walks further back)
    hist.append(entry)
    _write_json(os.path.join(d, "history.json"), hist)
    keep = set(h["release"] for h in hist[-a.get("keep", 5):])
    removed = []
    rel_dir = os.path.join(d, "releases")
    for name in sorted(os.listdir(rel_dir)):
        if name not in keep and not name.endswith(".failed"):
            shutil.rmtree(os.path.join(rel_dir, name), ignore_errors=True)
            removed.append(name)
    _write_json(os.path.join(d, "history.json"), [h for h in hist if h["release"] in keep])
    _out({"current": rel, "removed": removed, "models_removed": _gc_models(os.path.dirname(d))})


def discard(a):
    """Remove a release that never became current (it failed its checks)."""
    p = os.path.join(os.path.expanduser(a["dep"]), "releases", a["release"])
    shutil.rmtree(p, ignore_errors=True)  # its model stays in the store (the next deploy is likely to want it)
    _out({"removed": a["release"]})


def remove_deployment(a):
    """Delete a stopped deployment's directory (releases, run/, key, history), then the store entries
    no other deployment's release links."""
    d = os.path.realpath(os.path.expanduser(a["dep"]))
    root = os.path.dirname(d)
    if not os.path.isdir(os.path.join(d, "releases")) or os.path.basename(d) in ("models", "venvs", "bundles"):
        raise SystemExit("refusing to remove %s: not a deployment directory" % d)
    shutil.rmtree(d)
    _out({"removed": d, "models_removed": _gc_models(root), "venvs_removed": _gc_venvs(root) if a.get("venvs") else []})


def _gc_venvs(root):
    """Remove the venvs no release of any deployment under ``root`` links (`remove --venvs`; a probe builds
    its venv again when it needs one)."""
    venvs = os.path.join(root, "venvs")
    used = set()
    for dep in os.listdir(root) if os.path.isdir(root) else []:
        rel_dir = os.path.join(root, dep, "releases")
        for r in os.listdir(rel_dir) if dep != "venvs" and os.path.isdir(rel_dir) else []:
            link = os.path.join(rel_dir, r, "venv")
            if os.path.islink(link):
                used.add(os.path.realpath(link))
    removed = []
    for name in sorted(os.listdir(venvs)) if os.path.isdir(venvs) else []:
        p = os.path.join(venvs, name)
        if not name.startswith(".") and os.path.isdir(p) and os.path.realpath(p) not in used:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(name)
    return removed


def keygen(a):
    """The service's API key: created 0600 on the host if absent; never printed."""
    import secrets

    path = os.path.expanduser(a["path"])
    if a.get("replace"):  # a rotation: the new key renamed over the old one (never a half-written file)
        tmp = "%s.tmp-%d" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
        os.close(fd)
        if os.path.isfile(path):  # the old key, for the drain of the processes that still hold it
            os.replace(path, path + ".previous")
        os.replace(tmp, path)
        _out({"created": True, "replaced": True})
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        _out({"created": False})
        return
    os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
    os.close(fd)
    _out({"created": True})


def _http(url, key, body=None, timeout=60):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def smoke(a):
    """/health, /v1/models and one short completion on the local service. Read-only."""
    with open(os.path.expanduser(a["key_file"])) as fh:
        key = fh.read().strip()
    base = "http://127.0.0.1:%d" % a["port"]
    try:
        code, health = _http(base + "/health", key, timeout=10)
        if code != 200:
            _out({"ok": False, "reason": "/health answered %d: %s" % (code, health)})
            return
        _, models = _http(base + "/v1/models", key, timeout=10)
        model = models["data"][0]["id"]
        t0 = time.monotonic()
        _, done = _http(base + "/v1/completions", key, {"model": model, "prompt": a.get("prompt", "Hello"),
                                                         "max_tokens": 4, "temperature": 0}, timeout=120)
        text = done["choices"][0].get("text")
        if not isinstance(text, str) or done.get("usage", {}).get("completion_tokens", 0) < 1:
            _out({"ok": False, "reason": "the smoke completion returned no tokens: %s" % json.dumps(done)[:300]})
            return
        _out({"ok": True, "model": model, "health": health, "completion_tokens": done["usage"]["completion_tokens"],
              "completion_s": round(time.monotonic() - t0, 3)})
    except urllib.error.HTTPError as e:
        _out({"ok": False, "reason": "HTTP %d from the service: %s" % (e.code, e.read()[:300].decode(errors="replace"))})
    except (OSError, ValueError, KeyError, IndexError) as e:
        _out({"ok": False, "reason": "the service did not answer the smoke request: %s" % e})


def _in_flight(port, key):
    """Requests the service on ``port`` runs or queues now (its /metrics), or None when it does not answer."""
    req = urllib.request.Request("http://127.0.0.1:%d/metrics" % port, headers={"Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            text = resp.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    n = 0
    for line in text.splitlines():
        if line.startswith(("v100plan_requests_running ", "v100plan_queue_depth ")):
            n += int(float(line.split()[1]))
    return n


def drain(a):
    """After a switch: wait until the old release on ``port`` runs and queues nothing (twice in a row, half a
    second apart, so the last answer's bytes have left), up to ``timeout`` seconds. Read-only."""
    keys = []
    for path in (a["key_file"], a["key_file"] + ".previous"):  # after a key rotation the old one holds the old
        try:
            with open(os.path.expanduser(path)) as fh:
                keys.append(fh.read().strip())
        except OSError:
            pass
    t0 = time.monotonic()
    idle = 0
    left = None
    while True:
        answers = [n for n in (_in_flight(a["port"], k) for k in keys) if n is not None]
        left = answers[0] if answers else None
        idle = idle + 1 if not left else 0
        if idle >= 2:
            _out({"drained": True, "waited_s": round(time.monotonic() - t0, 1), "left": 0})
            return
        if time.monotonic() - t0 >= a["timeout"]:
            _out({"drained": False, "waited_s": round(time.monotonic() - t0, 1), "left": left})
            return
        time.sleep(0.5 if not left else 0.2)


def health(a):
    """GET /health on the local service, patiently (a loaded host answers slowly). Read-only."""
    url = "http://127.0.0.1:%d/health" % a["port"]
    req = urllib.request.Request(url)
    if a.get("key_file"):  # with the key /health has the details (ranks, allreduce path); without, its status
        try:
            with open(os.path.expanduser(a["key_file"])) as fh:
                req.add_header("Authorization", "Bearer " + fh.read().strip())
        except OSError:
            pass
    last = None
    for _ in range(a.get("tries", 3)):
        try:
            with urllib.request.urlopen(req, timeout=a.get("timeout", 10)) as resp:
                _out({"status": resp.status, "body": json.loads(resp.read())})
                return
        except urllib.error.HTTPError as e:
            last = {"status": e.code, "body": e.read()[:500].decode(errors="replace")}
        except (OSError, ValueError) as e:
            last = {"status": None, "error": str(e)}
        time.sleep(1)
    _out(last)


def _release_logs(run, release):
    """Where release ``release`` last ran (the slot that names it in release.txt, or that slot's logs.prev
    after a later start there) and its log names there, else (None, None)."""
    for slot in ("a", "b"):
        here = os.path.join(run, slot)
        for d, prefix in ((here, "logs/"), (os.path.join(here, "logs.prev"), "")):
            try:
                with open(os.path.join(d, "release.txt")) as fh:
                    if fh.read().strip() == release:
                        return d, prefix
            except OSError:
                continue
    return None, None


def logs(a):
    """The last ``lines`` lines of each service log (``release``: of the slot where that release last ran,
    a failed start included). Read-only."""
    run = os.path.expanduser(a["run"])
    out = {}
    files = list(a["files"])
    if a.get("release"):
        found, prefix = _release_logs(run, a["release"])
        if found is None:
            _out({"logs": {}, "found": None})
            return
        run = found
        files = [f if not f.startswith("logs/") else prefix + f[5:] for f in files]
        if not prefix:  # logs.prev holds the files flat: the rank logs too
            files += sorted(n for n in os.listdir(found) if re.match(r"^rank\d+\.g\d+\.log$", n))
            a = dict(a, rank_logs=False)
    if a.get("rank_logs"):  # each rank's log of the latest generation (the watchdog's restarts make new ones)
        latest = {}
        names = os.listdir(os.path.join(run, "logs")) if os.path.isdir(os.path.join(run, "logs")) else []
        for m in filter(None, (re.match(r"^rank(\d+)\.g(\d+)\.log$", n) for n in names)):
            if int(m.group(2)) >= latest.get(m.group(1), (-1, ""))[0]:
                latest[m.group(1)] = (int(m.group(2)), m.group(0))
        files += ["logs/" + latest[r][1] for r in sorted(latest, key=int)]
    for rel in files:
        p = os.path.join(run, rel)
        try:
            with open(p, "rb") as fh:
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - 256 * 1024))
                out[rel] = fh.read().decode(errors="replace").splitlines()[-a.get("lines", 50):]
        except OSError:
            out[rel] = None
    _out({"logs": out, "found": run})


def rotate_logs(a):
    """Move a stopped service's logs (run/service.log, run/logs/*) into run/logs.prev, replacing the set
    kept there: the next start writes empty logs (rank logs append, and request ids restart with the proxy)."""
    run = os.path.expanduser(a["run"])
    prev = os.path.join(run, "logs.prev")
    shutil.rmtree(prev, ignore_errors=True)
    os.makedirs(prev, mode=0o700)
    logs_dir = os.path.join(run, "logs")
    names = sorted(os.listdir(logs_dir)) if os.path.isdir(logs_dir) else []
    moved = []
    for src in [os.path.join(run, "service.log"), os.path.join(run, "release.txt")] + [
            os.path.join(logs_dir, n) for n in names]:
        if os.path.isfile(src):
            os.replace(src, os.path.join(prev, os.path.basename(src)))
            moved.append(os.path.basename(src))
    if not a.get("quiet"):
        _out({"moved": moved, "to": prev})


# -- the front and the two slots (blue/green) -------------------------------------------------------

def _start_ticks(pid):
    """Field 22 of /proc/PID/stat: when the process started (clock ticks since boot), or None."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError, TypeError):
        return None


def _alive(pid, ticks=None):
    """``pid`` runs (not a zombie) and, when ``ticks`` is given, is still the process that started then."""
    if not pid:
        return False
    try:
        with open("/proc/%d/stat" % pid) as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        return False
    return ticks is None or _start_ticks(pid) == ticks


def _read_int(path):
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _front_now(run, wait=0.0):
    """The front recorded in run/front.json, if that very process still runs (``supervised``: its keeper
    too). While its keeper runs, a front that died is waited for up to ``wait`` seconds (it restarts)."""
    deadline = time.monotonic() + wait
    while True:
        doc = _read_json(os.path.join(run, "front.json"), None)
        if doc and _alive(doc.get("pid"), doc.get("start_ticks")):
            doc["supervised"] = _alive(doc.get("keeper_pid"), doc.get("keeper_ticks"))
            return doc
        if not doc or time.monotonic() >= deadline or not _alive(doc.get("keeper_pid"), doc.get("keeper_ticks")):
            return None
        time.sleep(0.1)


def _ranks_alive(slot):
    """{PID: whether that very rank runs} for the ranks the slot's service.json records, each by its recorded
    start time where there is one (a PID another process took since is not alive)."""
    svc = _read_json(os.path.join(slot, "service.json"), {})
    times = svc.get("start_times")
    out = {}
    for pid in svc.get("rank_pids") or []:
        ticks = times.get(str(pid)) if isinstance(times, dict) else None
        out[str(pid)] = _alive(pid, ticks) if ticks is not None or not isinstance(times, dict) else False
    return out


def _front_record(run):
    """Each process of the front as it is now: the front (the port's listener) and its keeper, each with its
    PID and whether that very process runs. Read-only."""
    doc = _read_json(os.path.join(run, "front.json"), None)
    if not doc:
        return None
    return {"port": doc.get("port"),
            "front": {"pid": doc.get("pid"), "alive": _alive(doc.get("pid"), doc.get("start_ticks"))},
            "keeper": {"pid": doc.get("keeper_pid"),
                       "alive": _alive(doc.get("keeper_pid"), doc.get("keeper_ticks"))}}


def _lock_holder(path):
    """Who holds the deployment's lock now (its line: what, by whom, when), else None. Takes no lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        with os.fdopen(fd) as fh:
            return fh.read().strip() or "?"
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


def free_bytes(a):
    """Bytes free for this user on the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = os.path.expanduser(a["path"])
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    _out({"free_bytes": st.f_bavail * st.f_frsize, "path": p})


def free_port(a):
    """A port nothing on the host's 127.0.0.1 listens on now (for a release behind the front)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        _out({"port": s.getsockname()[1]})


def front(a):
    """Make sure a front listens on 127.0.0.1:``port`` for the deployment (front.py in ``run``). A front
    on another port is left running (the deploy stops it once the new one serves): it is returned as
    ``replaced``. A port that cannot be bound is the front's own message (Address already in use)."""
    run = os.path.expanduser(a["run"])
    os.makedirs(run, mode=0o700, exist_ok=True)
    now = _front_now(run, wait=5.0)
    if now and now.get("port") == a["port"] and now.get("supervised"):
        _out({"running": True, "started": False, "front": now})
        return
    if now and now.get("port") == a["port"]:  # its keeper is gone: started again, supervised (a short gap)
        _stop_front(now)
        now = None
    src = os.path.join(run, "front.py")
    tmp = "%s.tmp-%d" % (src, os.getpid())
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write(a["source"])
    os.replace(tmp, src)
    log = open(os.path.join(run, "front.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-B", src, "--port", str(a["port"]), "--run", run],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + a.get("wait", 10)
    while time.monotonic() < deadline:
        doc = _read_json(os.path.join(run, "front.json"), {})
        if doc.get("keeper_pid") == proc.pid and _alive(doc.get("pid"), doc.get("start_ticks")):
            _out({"running": True, "started": True, "front": doc, "replaced": now})
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.terminate()  # our own child, not yet recorded
    with open(os.path.join(run, "front.log"), "rb") as fh:
        lines = fh.read()[-4000:].decode(errors="replace").strip().splitlines()
    _out({"running": False, "error": lines[-1] if lines else "the front exited with %s" % proc.poll()})


def front_stop(a):
    """Stop the front ``front`` (a front.json record), or the one recorded in ``run``: only while its PID is
    still the process that started at the recorded time."""
    doc = a.get("front") or _read_json(os.path.join(os.path.expanduser(a["run"]), "front.json"), None)
    _out({"stopped": _stop_front(doc) if doc else None})


def _stop_front(doc):
    """Stop a front's keeper (first: it would start the front again), then the front; each only while it is
    the process recorded. The front's PID when it ran, else None."""
    ran = doc.get("pid") if _alive(doc.get("pid"), doc.get("start_ticks")) else None
    for pid_key, ticks_key in (("keeper_pid", "keeper_ticks"), ("pid", "start_ticks")):
        pid, ticks = doc.get(pid_key), doc.get(ticks_key)
        if not _alive(pid, ticks):
            continue
        os.kill(pid, 15)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(pid, ticks):
            time.sleep(0.05)
        if _alive(pid, ticks):
            os.kill(pid, 9)
    return ran


def route(a):
    """Point the front at a release's port: upstream.json replaced in one rename (the switch)."""
    run = os.path.expanduser(a["run"])
    doc = {"port": a["port"], "release": a["release"], "slot": a["slot"],
           "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_json(os.path.join(run, "upstream.json"), doc)
    _out(doc)


def slot_prepare(a):
    """Before a release starts in a slot: is a supervisord still running there (the caller stops it), and
    the slot's earlier logs moved to logs.prev so this start writes empty ones."""
    slot = os.path.expanduser(a["slot"])
    os.makedirs(slot, mode=0o700, exist_ok=True)
    pid = _read_int(os.path.join(slot, "supervisord.pid"))
    if _alive(pid):
        _out({"busy": pid})
        return
    rotate_logs({"run": slot, "quiet": True})
    if a.get("release"):  # which release this slot's logs are of (`v100plan logs --release`)
        tmp = os.path.join(slot, "release.txt.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(a["release"] + "\n")
        os.replace(os.path.join(slot, "release.txt.tmp"), os.path.join(slot, "release.txt"))
    _out({"busy": None})


_EXIT_LINE = re.compile(r"(exited|gave up): engine\b(.*)")


def _cause(slot):
    """The line of serve.stderr.log that says why the proxy ended (the exception, else the last line)."""
    try:
        with open(os.path.join(slot, "logs", "serve.stderr.log"), "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None, []
    hits = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln)]
    return (hits[-1] if hits else (lines[-1] if lines else None)), lines[-15:]


def await_health(a):
    """Wait for /health 200 on a new release's port while watching its processes: the first exit of the
    proxy (supervisord logs `exited: engine`) or supervisord gone ends the wait at once, with the cause
    from the proxy's log. Read-only."""
    slot = os.path.expanduser(a["slot"])
    url = "http://127.0.0.1:%d/health" % a["port"]
    sup_log = os.path.join(slot, "logs", "supervisord.log")
    t0 = time.monotonic()
    deadline = t0 + a["timeout"]
    last = None
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    _out({"ok": True, "seconds": round(time.monotonic() - t0, 2)})
                    return
        except urllib.error.HTTPError as e:
            last = "/health answered %d" % e.code
        except (OSError, ValueError) as e:
            last = "/health: %s" % e
        try:
            with open(sup_log, errors="replace") as fh:
                ended = [m.group(0) for m in map(_EXIT_LINE.search, fh) if m]
        except OSError:
            ended = []
        sup_pid = _read_int(os.path.join(slot, "supervisord.pid"))
        if ended or not _alive(sup_pid):
            cause, tail = _cause(slot)
            _out({"ok": False, "exited": True, "seconds": round(time.monotonic() - t0, 2),
                  "event": ended[-1] if ended else "supervisord is not running", "cause": cause, "tail": tail})
            return
        if time.monotonic() >= deadline:
            _, tail = _cause(slot)
            _out({"ok": False, "exited": False, "seconds": round(time.monotonic() - t0, 2), "cause": last,
                  "tail": tail})
            return
        time.sleep(0.2)


# -- after a reboot ---------------------------------------------------------------------------------
# A systemd user unit where the user's systemd manager runs and lingering is on (or can be switched on):
# it then starts at boot, not at the user's first login. Elsewhere (containers, hosts without systemd)
# a crontab @reboot line. One of the two, never both; `stop` takes out whichever there is.

UNIT = "systemd user unit"
CRON = "cron @reboot"


CRON_DAEMONS = ("cron", "crond", "cronie", "fcron", "dcron")


def _cron_runs():
    """True when a cron daemon runs on this host (a crontab line alone brings nothing back)."""
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if pid.isdigit():
            try:
                with open("/proc/%s/comm" % pid) as fh:
                    if fh.read().strip() in CRON_DAEMONS:
                        return True
            except OSError:
                continue
    return False


def _cron_mark(run):
    return "# v100plan-boot " + run


def _crontab():
    """The user's crontab lines, or None when this host has no `crontab`."""
    if shutil.which("crontab") is None:
        return None
    r = subprocess.run(["crontab", "-l"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
    return r.stdout.splitlines() if r.returncode == 0 else []


def _unit_dir():
    return os.path.join(os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "systemd", "user")


def unit_name(run):
    """The deployment's unit: one per run directory (so per remote root and deployment)."""
    return "v100plan-%s.service" % hashlib.sha256(run.encode()).hexdigest()[:12]


def _unit_enabled(run):
    return os.path.islink(os.path.join(_unit_dir(), "default.target.wants", unit_name(run)))


def _user_name():
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _quiet(cmd):
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, "", str(e)
    return r.returncode, r.stdout.strip(), r.stderr.strip()


def systemd_user():
    """(True, None) when a user unit would start at boot here: `systemctl --user` reaches the user's
    manager, and lingering is on for this user (switched on now with `loginctl enable-linger` if the host
    allows it). Else (False, why not)."""
    if shutil.which("systemctl") is None:
        return False, "no systemctl on this host"
    code, _, err = _quiet(["systemctl", "--user", "show-environment"])
    if code != 0:
        return False, "systemd --user is not available here (%s)" % (err.splitlines() or ["exit %d" % code])[-1]
    user = _user_name()
    code, out, _ = _quiet(["loginctl", "show-user", user, "--property", "Linger", "--value"])
    if out != "yes":
        code, _, err = _quiet(["loginctl", "enable-linger", user])
        if code != 0:
            return False, ("lingering cannot be switched on for %s (%s): a user unit would start only at login"
                           % (user, (err.splitlines() or ["exit %d" % code])[-1]))
    return True, None


def _unit_quote(path):
    """A path as one ExecStart argument (systemd's quoting; % is its specifier character)."""
    return '"%s"' % path.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


def unit_text(description, script):
    """The user unit that runs boot.sh once at boot; the processes it starts stay (RemainAfterExit)."""
    return "\n".join([
        "[Unit]",
        "Description=%s" % description.replace("%", "%%"),
        "",
        "[Service]",
        "Type=oneshot",
        "RemainAfterExit=yes",
        "ExecStart=/bin/sh %s" % _unit_quote(script),
        "TimeoutStartSec=600",
        "",
        "[Install]",
        "WantedBy=default.target",
        ""])


def _boot_now(run):
    """How the deployment comes back after a reboot: UNIT when its user unit is enabled, CRON when the
    user's crontab has its line, else None."""
    if _unit_enabled(run):
        return UNIT
    lines = _crontab()
    return CRON if lines and any(ln.endswith(_cron_mark(run)) for ln in lines) and _cron_runs() else None


def _sh(word):
    return "'" + str(word).replace("'", "'\\''") + "'"


def _drop_unit(run):
    path = os.path.join(_unit_dir(), unit_name(run))
    if _unit_enabled(run) or os.path.exists(path):
        _quiet(["systemctl", "--user", "disable", unit_name(run)])
        with_link = os.path.join(_unit_dir(), "default.target.wants", unit_name(run))
        for p in (with_link, path):
            if os.path.lexists(p):
                os.unlink(p)
        _quiet(["systemctl", "--user", "daemon-reload"])


def _drop_cron(run, lines):
    mark = _cron_mark(run)
    if lines and any(ln.endswith(mark) for ln in lines):
        _set_crontab([ln for ln in lines if not ln.endswith(mark)])


def boot(a):
    """Write run/boot.sh (the front on its port, then the serving slot's release under its supervisor) and
    make sure it runs at boot: a systemd user unit where that works, else the user's crontab @reboot;
    ``remove``: take either out (`stop`)."""
    run = os.path.expanduser(a["run"])
    lines = _crontab()
    mark = _cron_mark(run)
    if a.get("remove"):
        _drop_unit(run)
        _drop_cron(run, lines)
        _out({"boot": None})
        return
    script = os.path.join(run, "boot.sh")
    slot = os.path.expanduser(a["slot"])
    text = "\n".join([
        "#!/bin/sh",
        "# written by v100plan at each switch: brings this deployment back after a reboot (its front on",
        "# 127.0.0.1:%d, then release %s in %s); `v100plan stop` takes it out of the boot" % (
            a["port"], a["release"], slot),
        "%s -B %s --port %d --run %s >> %s 2>&1 < /dev/null &" % (
            _sh(sys.executable), _sh(os.path.join(run, "front.py")), a["port"], _sh(run),
            _sh(os.path.join(run, "front.log"))),
        "cd %s || exit 1" % _sh(os.path.expanduser(a["release_dir"])),
        "exec ./venv/bin/python -m engine supervise start --state-dir %s --wait-healthy-s 0 -- %s >> %s 2>&1" % (
            _sh(slot), " ".join(_sh(f) for f in a["flags"]), _sh(os.path.join(run, "boot.log"))),
        ""])
    tmp = "%s.tmp-%d" % (script, os.getpid())
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700), "w") as fh:
        fh.write(text)
    os.replace(tmp, script)
    use_unit, why_not = systemd_user()
    if use_unit:
        os.makedirs(_unit_dir(), mode=0o700, exist_ok=True)
        path = os.path.join(_unit_dir(), unit_name(run))
        _write_text(path, unit_text("v100plan deployment %s (front on 127.0.0.1:%d)" % (run, a["port"]), script))
        _quiet(["systemctl", "--user", "daemon-reload"])
        code, _, err = _quiet(["systemctl", "--user", "enable", unit_name(run)])
        if code == 0:
            _drop_cron(run, lines)  # one mechanism: the unit
            _out({"boot": UNIT, "script": script, "unit": path})
            return
        why_not = "systemctl --user enable %s failed (%s)" % (unit_name(run), err[-200:])
    if lines is None:
        _out({"boot": None, "script": script, "why": "%s, and this host has no crontab: run %s at boot yourself"
              % (why_not, script)})
        return
    entry = "@reboot %s %s" % (_sh(script), mark)
    if entry not in lines:
        _set_crontab([ln for ln in lines if not ln.endswith(mark)] + [entry])
    if not _cron_runs():  # the line is there for when cron runs; until then nothing brings it back
        _out({"boot": None, "script": script, "entry": entry,
              "why": "%s, and no cron daemon runs here (%s): the crontab line %r waits for one; start cron, or run "
                     "%s at boot yourself" % (why_not, "/".join(CRON_DAEMONS), entry, script)})
        return
    _out({"boot": CRON, "script": script, "entry": entry, "why_not_unit": why_not})


def _write_text(path, text):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _set_crontab(lines):
    r = subprocess.run(["crontab", "-"], input="".join(ln + "\n" for ln in lines), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=30)
    if r.returncode != 0:
        raise SystemExit("crontab - failed: %s" % r.stderr.strip()[-300:])


ACTIONS = {f.__name__: f for f in (state, mkdirs, extract, venv, site_check, sha256, unlink, verified, lock, switch, discard,
                                   keygen, smoke, health, logs, rotate_logs, free_port, front, front_stop, route,
                                   slot_prepare, await_health, boot, free_bytes, drain,
                                   remove_deployment)}

if __name__ == "__main__":
    try:
        ACTIONS[sys.argv[1]](json.loads(sys.argv[2]))
    except Untrusted as e:  # said as it is: a folder of another user's, never used
        _out({"untrusted": str(e)})
        sys.exit(3)
