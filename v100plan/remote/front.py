"""The front of a deployment on its host: ``python3 front.py --port P --run DIR``.

A TCP forwarder on 127.0.0.1:P, the port the operator deployed to. Each new connection goes to
the upstream port that DIR/upstream.json names (``{"port": U, "release": ..., "slot": ...}``),
read again whenever that file is replaced: renaming a new upstream.json over the old one is the
switch from one release to the next, with no moment where P refuses a connection. Connections
already open stay with the release they reached; the deploy stops that release afterwards (its
proxy drains them first).

Stdlib only: it runs with the host's Python, outside every release's venv, and outlives them.
It is supervised as the proxy and ranks are: ``front.py --port P --run DIR`` is the front's keeper,
which starts the front (``--serve``) and starts it again, within half a second, whenever it dies
(a SIGKILL too); SIGTERM to the keeper stops both. The front binds the socket once and forks the
forwarder, again whenever it dies (connections wait in the listen queue meanwhile). Once bound,
the front records itself and its keeper in DIR/front.json (PIDs and start times, /proc/PID/stat
field 22, so only these processes are ever signalled). A port the first front cannot bind is
printed (``Address already in use``) and both exit 3.
"""

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time


def start_ticks(pid):
    """Field 22 of /proc/PID/stat (the start time in clock ticks since boot), or None."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Upstream:
    """The upstream port from DIR/upstream.json, read again when the file is replaced."""

    def __init__(self, run):
        self.path = os.path.join(run, "upstream.json")
        self.key = None
        self.port = None

    def get(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return self.port
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self.key:
            try:
                with open(self.path) as fh:
                    self.port = int(json.load(fh)["port"])
                self.key = key
            except (OSError, ValueError, KeyError, TypeError):
                pass  # half-written by hand: keep the last good one
        return self.port


def _pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _handle(client, port):
    try:
        up = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        client.close()  # the client sees the connection close, as it would with nothing listening
        return
    up.settimeout(None)
    for s in (client, up):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(up, client), daemon=True)
    back.start()
    _pump(client, up)
    back.join()
    client.close()
    up.close()


def forward(listener, run):
    upstream = Upstream(run)
    while True:
        client, _ = listener.accept()
        port = upstream.get()
        if port is None:
            client.close()
            continue
        threading.Thread(target=_handle, args=(client, port), daemon=True).start()


def _die_with(parent):
    """The forwarder ends when the parent does, however it ends (SIGKILL too): the port is the parent's
    (PR_SET_PDEATHSIG, Linux; elsewhere the forwarder outlives a killed parent until its next accept)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


def keep(argv):
    """The keeper: run the front (this file with --serve) and start it again whenever it ends; SIGTERM or
    SIGINT stop the front, then the keeper. A first front that exits 3 (port taken) ends the keeper with 3."""
    child = {"proc": None, "stopping": False}

    def stop(signum, frame):
        child["stopping"] = True
        if child["proc"] is not None and child["proc"].poll() is None:
            child["proc"].terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    import subprocess

    first = True
    while not child["stopping"]:
        child["proc"] = subprocess.Popen([sys.executable, "-B", os.path.abspath(__file__), "--serve", *argv])
        code = child["proc"].wait()
        if child["stopping"]:
            break
        if first and code == 3:
            return 3
        first = False
        print("front: the front (pid %d) ended (status %d); starting it again" % (child["proc"].pid, code),
              file=sys.stderr, flush=True)
        time.sleep(0.3)
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve" not in argv:
        return keep(argv)
    argv.remove("--serve")
    p = argparse.ArgumentParser(prog="front.py", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run", required=True)
    args = p.parse_args(argv)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", args.port))
    except OSError as e:
        print("front: cannot listen on 127.0.0.1:%d: %s" % (args.port, e.strerror or e), file=sys.stderr, flush=True)
        return 3
    listener.listen(512)
    child = {"pid": None}

    def stop(signum, frame):
        if child["pid"]:
            try:
                os.kill(child["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    keeper = os.getppid()
    doc = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "port": args.port,
           "keeper_pid": keeper, "keeper_ticks": start_ticks(keeper), "started_unix": round(time.time(), 3)}
    tmp = os.path.join(args.run, "front.json.tmp-%d" % os.getpid())
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, os.path.join(args.run, "front.json"))
    print("front: 127.0.0.1:%d, upstream from %s/upstream.json (pid %d)" % (args.port, args.run, os.getpid()),
          file=sys.stderr, flush=True)
    while True:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _die_with(parent)
            try:
                forward(listener, args.run)
            finally:
                os._exit(1)
        child["pid"] = pid
        _, status = os.waitpid(pid, 0)
        print("front: the forwarder (pid %d) ended (status %d); starting it again" % (pid, status),
              file=sys.stderr, flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
