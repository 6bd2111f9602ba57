"""The speculative-decoding flags shared by `python -m engine generate`, `serve` and `rank` (stdlib only: the
proxy reads them without torch). engine.core.mtp runs what they ask for."""

from __future__ import annotations

import argparse

MAX_DRAFT_TOKENS = 4
CHOICES = ("off", "mtp")
DEFAULT_DRAFT_TOKENS = 3  # the field system's setting (FACTS.md: 3 drafts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=CHOICES, default="off",
                   help="mtp: the model's own MTP draft layer proposes --draft-tokens tokens per round and one "
                        "forward verifies them (greedy output is unchanged); needs a checkpoint with mtp.* tensors "
                        "(default: off)")
    p.add_argument("--draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, metavar="K",
                   help=f"with --speculative mtp: drafts per round, 1 to {MAX_DRAFT_TOKENS} "
                        f"(default: {DEFAULT_DRAFT_TOKENS})")


def draft_tokens(args: argparse.Namespace) -> int:
    """Drafts per round the flags ask for (0: no speculation); ValueError naming the flag when out of range."""
    if args.speculative == "off":
        return 0
    if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--draft-tokens must be 1 to {MAX_DRAFT_TOKENS}, got {args.draft_tokens}")
    return args.draft_tokens
