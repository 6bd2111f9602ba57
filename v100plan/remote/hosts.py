"""Host specs (`user@host[:port]`) and inventory files: what `--host` and `--inventory` accept.

An inventory file lists one host spec a line; `#` starts a comment, blank lines are skipped.
A host given without a user or port takes them from ~/.ssh/config (Fabric's Config reads it),
else the local user name and port 22.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from v100plan.errors import BadInput

_HOST_RE = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*)@)?"
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))"
    r"(?::(?P<port>[0-9]{1,5}))?$"
)


@dataclass(frozen=True)
class HostSpec:
    host: str
    user: str | None = None
    port: int | None = None

    @property
    def label(self) -> str:
        """How the host is named in output and in results keyed by host (what the user typed)."""
        h = f"[{self.host}]" if ":" in self.host else self.host
        return (f"{self.user}@" if self.user else "") + h + (f":{self.port}" if self.port else "")

    def __str__(self) -> str:
        return self.label


def parse_host(text: str) -> HostSpec:
    """``user@host[:port]``, ``host``, ``[::1]:2222``; anything else is bad input (exit 2)."""
    m = _HOST_RE.match(text.strip())
    if not m or text.strip().startswith("-"):
        raise BadInput(f"host {text!r} is not user@host[:port]",
                       hint="e.g. ubuntu@gpu-box or ubuntu@10.0.0.7:2222 ([::1]:2222 for IPv6)")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 1 <= port <= 65535:
        raise BadInput(f"host {text!r}: port {port} is out of range", hint="a port is 1-65535")
    return HostSpec(host=m["v6"] or m["name"], user=m["user"], port=port)


def read_inventory(path: str | Path) -> list[HostSpec]:
    """One host spec a line; a bad line is named by its number."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise BadInput(f"inventory {str(p)!r} cannot be read: {e.strerror or e}",
                       hint="give --inventory a text file with one user@host[:port] a line") from None
    hosts: list[HostSpec] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            hosts.append(parse_host(line))
        except BadInput as e:
            raise BadInput(f"inventory {str(p)!r} line {n}: {e.message}", hint=e.hint) from None
    if not hosts:
        raise BadInput(f"inventory {str(p)!r} lists no hosts", hint="one user@host[:port] a line")
    return hosts


def collect_hosts(hosts: list[str] | None, inventory: str | Path | None) -> list[HostSpec]:
    """The hosts named by --host and --inventory together, each once, in the order given."""
    specs = [parse_host(h) for h in hosts or []]
    if inventory is not None:
        specs += read_inventory(inventory)
    seen: set[HostSpec] = set()
    out = []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out
