"""The language model's multimodal rotary positions (Qwen3.5's interleaved M-RoPE) for a prompt with images.

Every prompt position has three positions (time, height, width). A text token has all three equal: the next
position after what came before, so text alone is plain RoPE. An image of gh x gw patches merged m x m takes
gh/m x gw/m tokens, row by row, at time = the position the image starts at, height = start + its row, width =
start + its column; the text after it continues at start + max(gh, gw) / m. The rotary frequencies are dealt
to the three by the text config's ``mrope_section`` (t, h, w) interleaved: frequency j turns with height when
j % 3 == 1 and j < 3 h, with width when j % 3 == 2 and j < 3 w, else with time (transformers' Qwen3.5 rule).

How the engine uses it: the model's cos / sin tables (engine.core.model.Model.setup_cache: one row per cache
position) are rewritten in place, from the first image token on, with this sequence's rows: the image tokens'
three-way rows, then every later position p at p + delta (delta = the positions an image saves: its tokens
minus its extent). The prefill, the decode step (eager or replayed from a CUDA graph), the MTP draft layer and
the speculative verification all read these tables by cache position, so they all turn with the multimodal
positions and none of them changes. A request without images puts the plain rows back (``restore``).
"""

from __future__ import annotations

import torch

from engine.vision.config import VisionConfig


def positions(ids: list[int], spans: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, int]:
    """(positions [3, T] int64, delta) of a prompt: ``spans`` lists each image as (first token index, tokens,
    merged grid height, merged grid width); delta = max position + 1 - T, what every later token adds to its
    cache position."""
    out = torch.empty(3, len(ids), dtype=torch.int64)
    cur, i = 0, 0
    for start, n, gh, gw in sorted(spans):
        if start > i:  # text before the image
            out[:, i:start] = torch.arange(cur, cur + start - i)
            cur += start - i
        rows = torch.arange(gh).repeat_interleave(gw)
        cols = torch.arange(gw).repeat(gh)
        out[0, start:start + n] = cur
        out[1, start:start + n] = cur + rows
        out[2, start:start + n] = cur + cols
        cur += max(gh, gw)
        i = start + n
    if i < len(ids):
        out[:, i:] = torch.arange(cur, cur + len(ids) - i)
        cur += len(ids) - i
    return out, cur - len(ids)


def sections(rot_half: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Which of (time, height, width) each of the rot_half frequencies turns with: [rot_half] int64 in {0, 1, 2}."""
    j = torch.arange(rot_half)
    which = torch.zeros(rot_half, dtype=torch.int64)
    which[(j % 3 == 1) & (j < 3 * section[1])] = 1
    which[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return which


def table_rows(model, pos3: torch.Tensor, section: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos [R, rot], sin [R, rot]) in the model's dtype of rows with positions pos3 [3, R], by the same float32
    arithmetic as the model's plain table (so a text row is the plain row, bit for bit)."""
    from engine.core.model import rope_attention_factor

    inv = model._inv_freq  # [rot / 2], float32 on the model's device
    freqs = pos3.to(model.device, torch.float32)[:, :, None] * inv[None, None, :]  # [3, R, rot / 2]
    which = sections(inv.shape[0], section).to(model.device)
    f = freqs.gather(0, which.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]  # [R, rot / 2]
    emb = torch.cat((f, f), dim=-1)
    af = rope_attention_factor(model.cfg)
    return (emb.cos() * af).to(model.dtype), (emb.sin() * af).to(model.dtype)


def write(model, pos3: torch.Tensor, delta: int, first: int, cfg: VisionConfig) -> None:
    """Rewrite the model's tables from cache position ``first`` (the first image token) to the end of the
    allocated context: the prompt's rows from pos3 [3, T], every later position p at p + delta."""
    t, end = pos3.shape[1], model.max_context
    later = torch.arange(t, end, dtype=torch.int64) + delta
    rows = torch.cat([pos3[:, first:], later.expand(3, -1)], dim=1)  # [3, end - first]
    cos, sin = table_rows(model, rows, cfg.mrope_section)
    model.cos[first:end].copy_(cos)
    model.sin[first:end].copy_(sin)


def restore(model, first: int, cfg: VisionConfig) -> None:
    """The plain rows back from cache position ``first`` on (a request without images follows one with)."""
    p = torch.arange(first, model.max_context, dtype=torch.int64).expand(3, -1)
    cos, sin = table_rows(model, p, cfg.mrope_section)
    model.cos[first:].copy_(cos)
    model.sin[first:].copy_(sin)
