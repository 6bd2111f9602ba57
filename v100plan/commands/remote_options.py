"""Options every remote command shares (deploy, rollback, status, logs, stop, probe --host,
accept --host, qualify --host), declared once.

``@remote_options(...)`` adds them to a Typer command's signature and hands the command one
``remote: RemoteArgs`` argument in their place. Each also reads an environment variable where
it names a file or a place, so a test run or a CI job can point all of them at its own
known_hosts, key and remote root once.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from v100plan import output
from v100plan.errors import BadInput

# The engine settings deploy takes from the plan (or the probe) unless given here.
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="float16, bfloat16 or float32 (default: the plan's, else by the cards: fp16 on compute capability 7.x).")]
KvCacheDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-cache-dtype", help="auto (the model's dtype) or int8 (default: the plan's, else auto).")]
SpeculativeOpt = Annotated[Optional[str], typer.Option(
    "--speculative", help="mtp (the model's MTP draft layer) or off (default: the plan's, else off).")]
DraftTokensOpt = Annotated[Optional[int], typer.Option(
    "--draft-tokens", metavar="K", help="MTP drafts per round (implies --speculative mtp; default: the plan's).")]
AllreduceOpt = Annotated[Optional[str], typer.Option(
    "--allreduce", help="the ranks' allreduce path (default: the plan's, else auto: the engine's start-up race).")]
MaxConcurrencyOpt = Annotated[Optional[str], typer.Option(
    "--max-concurrency", metavar="N|memory",
    help="Requests the engine decodes at once, 1-64, or memory: as many as fit the cards (serve's default there; "
         "default: the plan's concurrency, else 1 on GPUs and the engine's default on CPU).")]
KnownHostsOpt = Annotated[Optional[str], typer.Option(
    "--known-hosts", metavar="FILE", envvar="V100PLAN_KNOWN_HOSTS",
    help="known_hosts file to trust (default: ssh_config's UserKnownHostsFile, else ~/.ssh/known_hosts).")]
AcceptNewOpt = Annotated[bool, typer.Option(
    "--accept-new-host-key", help="Record an UNKNOWN host key in known_hosts (a changed key still fails).")]
IdentityOpt = Annotated[Optional[str], typer.Option(
    "--identity", "-i", metavar="KEY", envvar="V100PLAN_SSH_IDENTITY",
    help="SSH private key (default: ~/.ssh/config, the agent, ~/.ssh/id_*).")]
RemoteRootOpt = Annotated[str, typer.Option(
    "--remote-root", envvar="V100PLAN_REMOTE_ROOT", help="Where v100plan keeps its files on the host.")]
RemotePythonOpt = Annotated[str, typer.Option(
    "--remote-python", envvar="V100PLAN_REMOTE_PYTHON",
    help="The host's Python (3.10+) that builds venvs and runs the helper.")]
SitePackagesOpt = Annotated[bool, typer.Option(
    "--remote-site-packages", envvar="V100PLAN_REMOTE_SITE_PACKAGES",
    help="Make the host's venvs see --remote-python's site packages (venv --system-site-packages): a torch "
         "the host already has (NGC image, conda, a system venv) is used, not installed again.")]
ConnectTimeoutOpt = Annotated[float, typer.Option(
    "--connect-timeout", metavar="S", help="Seconds to wait for the SSH handshake.")]
CommandTimeoutOpt = Annotated[float, typer.Option(
    "--command-timeout", metavar="S", help="Seconds any one remote command may run before it is stopped there.")]
IndexUrlOpt = Annotated[Optional[str], typer.Option(
    "--index-url", help="Extra package index for the host's venv (a CUDA 12.x torch for a V100).")]
TorchOpt = Annotated[Optional[str], typer.Option(
    "--torch", help="torch requirement for the host (default: the version installed here).")]
DrainTimeoutOpt = Annotated[float, typer.Option(
    "--drain-timeout", metavar="S",
    help="After a switch, seconds the old release may take to finish the answers it is giving (it is stopped "
         "as soon as it has none; what is left then ends with 503). Default 300: a 4,096-token answer at "
         "14 tok/s (docs/deploy.md, \"Draining\").")]
KeepReleasesOpt = Annotated[int, typer.Option(
    "--keep-releases", metavar="N", help="Releases kept on the host for rollback, the current one among them.")]
DEPLOYMENT_HELP = "Name of the deployment on the host (several can live side by side)."


def deployment_opt(help_text: str = DEPLOYMENT_HELP):  # noqa: ANN201 - an Annotated alias
    return Annotated[str, typer.Option("--deployment", "-d", help=help_text)]


DeploymentOpt = deployment_opt()
DEFAULT_ROOT = "~/.v100plan"


@dataclass(frozen=True)
class RemoteArgs:
    """What the shared options say, checked: where v100plan lives on the host and how SSH reaches it."""

    deployment: str | None
    remote_root: str
    remote_python: str
    known_hosts: str | None
    accept_new_host_key: bool
    identity: str | None
    connect_timeout: float
    command_timeout: float
    remote_site_packages: bool = False

    @property
    def ssh(self):  # noqa: ANN201 - v100plan.remote.connect.SshOptions (fabric stays unimported until used)
        """The SSH options, checked when a command first needs them (a local probe never does)."""
        from v100plan.remote.connect import SshOptions

        for name, v in (("--connect-timeout", self.connect_timeout), ("--command-timeout", self.command_timeout)):
            if v <= 0:
                raise BadInput(f"{name} must be a positive number of seconds, got {v:g}", hint=f"e.g. {name} 30")
        if self.identity and not os.path.isfile(os.path.expanduser(self.identity)):
            raise BadInput(f"--identity {self.identity!r}: no such key file here",
                           hint="give the private key's path (-i ~/.ssh/id_ed25519), or leave -i out to use "
                                "~/.ssh/config, the agent and ~/.ssh/id_*")
        return SshOptions(known_hosts=self.known_hosts, accept_new_host_key=self.accept_new_host_key,
                          identity=self.identity, connect_timeout_s=self.connect_timeout,
                          command_timeout_s=self.command_timeout)

    def settings(self, index_url: str | None = None, torch: str | None = None):  # noqa: ANN201
        """The host-side settings (v100plan.remote.host.RemoteSettings)."""
        from v100plan.remote.host import RemoteSettings

        return RemoteSettings(root=self.remote_root, python=self.remote_python, index_url=index_url, torch=torch,
                              site_packages=self.remote_site_packages)

    def target(self, host: str, index_url: str | None = None, torch: str | None = None):  # noqa: ANN201
        """The deployment on ``host`` (v100plan.remote.supervisor.Target)."""
        from v100plan.remote import release as rel
        from v100plan.remote.hosts import parse_host
        from v100plan.remote.supervisor import Target

        return Target(parse_host(host), self.ssh, self.settings(index_url, torch),
                      rel.deployment_name(self.deployment or "engine"))


def switch_target(target, drain_timeout: float, keep_releases: int):  # noqa: ANN001, ANN201 - a Target
    """``target`` with a switch's --drain-timeout and --keep-releases, checked."""
    from dataclasses import replace

    if drain_timeout < 0:
        raise BadInput(f"--drain-timeout must be 0 or more seconds, got {drain_timeout:g}",
                       hint="e.g. --drain-timeout 600 (0: stop the old release at once)")
    if keep_releases < 1:
        raise BadInput(f"--keep-releases must be 1 or more, got {keep_releases}",
                       hint="e.g. --keep-releases 3 (2 or more keeps one to roll back to)")
    return replace(target, drain_timeout_s=drain_timeout, keep_releases=keep_releases)


def option_group(param: str, options: dict[str, tuple[Any, Any]],
                 make: Callable[[dict[str, Any]], Any]) -> Callable[[Callable], Callable]:
    """Declare ``options`` ({name: (Annotated type, default)}) once for many commands: the decorated
    command's ``param`` parameter is replaced by them (in its help too), and the command is called
    with ``param=make({name: value})`` instead."""

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        at = list(sig.parameters).index(param)
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=t, default=d)
                 for n, (t, d) in options.items()]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values()]
        params = own[:at] + added + own[at + 1:]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            group = make({n: kwargs.pop(n) for n in options})
            return fn(**kwargs, **{param: group})

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def remote_options(*, command_timeout: float = 120.0, deployment: str | None = "engine",
                   deployment_help: str = DEPLOYMENT_HELP) -> Callable[[Callable], Callable]:
    """Give a command the shared remote options (``deployment=None``: no --deployment) in place of its
    ``remote`` parameter, and call it with ``remote=RemoteArgs(...)``."""
    options: dict[str, tuple[Any, Any]] = {
        "deployment": (deployment_opt(deployment_help), deployment),
        "remote_root": (RemoteRootOpt, DEFAULT_ROOT), "remote_python": (RemotePythonOpt, "python3"),
        "remote_site_packages": (SitePackagesOpt, False),
        "known_hosts": (KnownHostsOpt, None), "accept_new_host_key": (AcceptNewOpt, False),
        "identity": (IdentityOpt, None), "connect_timeout": (ConnectTimeoutOpt, 10.0),
        "command_timeout": (CommandTimeoutOpt, command_timeout),
    }
    if deployment is None:
        del options["deployment"]
    return option_group("remote", options, lambda got: RemoteArgs(**{"deployment": None, **got}))


HostArg = Annotated[str, typer.Argument(metavar="HOST", help="user@host[:port] (or a Host from ~/.ssh/config)")]
FleetHostArg = Annotated[Optional[str], typer.Argument(
    metavar="[HOST]", help="user@host[:port] (or a Host from ~/.ssh/config); or give --inventory")]
InventoryOpt = Annotated[Optional[str], typer.Option(
    "--inventory", metavar="FILE", help="Every host of FILE (one user@host[:port] a line, as `probe --inventory`), "
                                        "in parallel: one row per host; a failed host never stops the others; "
                                        "the exit code is the worst host's.")]


def targets_of(remote: RemoteArgs, host: str | None, inventory: str | None, index_url: str | None = None,
               torch: str | None = None) -> list:
    """The targets HOST or --inventory name (exactly one of the two)."""
    from dataclasses import replace

    from v100plan.remote.hosts import read_inventory

    if (host is None) == (inventory is None):
        raise BadInput("give exactly one of HOST and --inventory FILE",
                       hint="e.g. v100plan status ubuntu@gpu-box, or --inventory hosts.txt")
    if host is not None:
        return [remote.target(host, index_url, torch)]
    specs = read_inventory(inventory)
    first = remote.target(specs[0].label, index_url, torch)
    return [replace(first, spec=s) for s in specs]


def emit_fleet(action: str, inventory: str, results: list, fields: tuple[str, ...], json_out: bool,
               quiet: bool) -> None:
    """The fleet's table (or document), the failed hosts named on stderr, and the worst host's exit code."""
    from v100plan.remote import fleet

    doc = fleet.fleet_document(action, inventory, results)
    if json_out:
        output.emit_json(doc)
    elif not quiet:
        output.render(output.table(f"{action.capitalize()} ({len(results)} hosts)", ["host", "result", *fields],
                                   fleet.rows(results, fields)))
    failed = [r for r in results if r.exit_code]
    if failed:
        output.error(f"{len(failed)} of {len(results)} host(s) failed: "
                     + "; ".join(f"{r.host} ({r.error or 'exit %d' % r.exit_code})" for r in failed),
                     failed[0].hint)
        raise typer.Exit(doc["exit_code"])


def say(quiet: bool):  # noqa: ANN202
    return (lambda s: None) if quiet else output.hint


def emit(doc: dict, rows: list[tuple[str, object]], title: str, json_out: bool, quiet: bool) -> None:
    if json_out:
        output.emit_json(doc)
    elif not quiet:
        output.render(output.table(title, ["", "value"], rows))
