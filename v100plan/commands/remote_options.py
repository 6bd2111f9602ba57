"""Options every remote command shares (deploy, rollback, status, logs, stop, probe --host).

Each also reads an environment variable, so a test run or a CI job can point all of
them at its own known_hosts, key and remote root once.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from v100plan.errors import BadInput

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
ConnectTimeoutOpt = Annotated[float, typer.Option(
    "--connect-timeout", metavar="S", help="Seconds to wait for the SSH handshake.")]
CommandTimeoutOpt = Annotated[float, typer.Option(
    "--command-timeout", metavar="S", help="Seconds any one remote command may run before it is stopped there.")]
DeploymentOpt = Annotated[str, typer.Option(
    "--deployment", "-d", help="Name of the deployment on the host (several can live side by side).")]


def ssh_options(known_hosts, accept_new, identity, connect_timeout, command_timeout):  # noqa: ANN001, ANN201
    from v100plan.remote.connect import SshOptions

    for name, v in (("--connect-timeout", connect_timeout), ("--command-timeout", command_timeout)):
        if v <= 0:
            raise BadInput(f"{name} must be a positive number of seconds, got {v:g}", hint=f"e.g. {name} 30")
    return SshOptions(known_hosts=known_hosts, accept_new_host_key=accept_new, identity=identity,
                      connect_timeout_s=connect_timeout, command_timeout_s=command_timeout)
