"""(commands to come)"""

import typer


def register(app: typer.Typer) -> None:
    return None
