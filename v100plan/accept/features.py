"""Scenarios for the serving features of the bundled engine: prefix reuse across the turns of a
conversation, MTP speculative decoding (greedy answers equal one-token decoding's), and a rank
fault during a speculative stream (no wrong token).

What the service runs with comes from the service itself: its keyed /health (each rank's
``prefix_cache``; a ``speculative`` block where the engine reports one) and, for speculation, its
/metrics (v100plan/accept/serving.py). Registered after the functional and fault cases they extend.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.service.causes import SCENARIOS
from v100plan.accept import functional  # imported first, its cases register (and run, and report) first
from v100plan.accept.cases import Outcome, case
from v100plan.accept.context import PROMPTS, REF_TOKENS, Context
from v100plan.accept.faults import _failure_cause, _needs_control, _rank_action, _run_fault, _timeout
from v100plan.accept.serving import SPEC_DRAFTS, health_block, spec_counters, speculation

F = "functional"
# A conversation as plain text turns (any tokenizer takes it; the chat template plays no part), its
# follow-up, and unrelated prompts whose first characters differ from the conversation's and from each other's, one
# per sequence slot, so the engine (whose slots each keep one sequence's state, engine/core/prefix.py and
# engine/service/rank_batch.py) holds nothing the follow-up can reuse once they ran.
TURN_1 = "User: Tell me about the quick brown fox.\nAssistant:"
FOLLOW_UP = "\nUser: And what did the fox do next?\nAssistant:"
UNRELATED = "another conversation begins here"
OPENERS = ("Quite", "Now", "Here", "Then", "Later", "Elsewhere", "Meanwhile", "Today")
TURN_TOKENS = 16
NO_SPEC = ("speculation is off on this service: serve --speculative mtp [--draft-tokens K] turns it on (the model "
           "needs an MTP draft layer: mtp_num_hidden_layers in its config.json and mtp.* tensors, e.g. python -m "
           "engine make-demo-model DIR --arch qwen3_5 --mtp)")


def _cached(a) -> int | None:
    details = ((a.body or {}).get("usage") or {}).get("prompt_tokens_details") if isinstance(a.body, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def _prompt_tokens(a) -> int | None:
    return ((a.body or {}).get("usage") or {}).get("prompt_tokens") if isinstance(a.body, dict) else None


# ----- prefix reuse -----------------------------------------------------------------------------------

def _prefix_applicable(ctx: Context) -> str | None:
    if not ctx.is_engine:
        return f"needs the bundled engine (its v100plan extension); this server is {ctx.server or 'another make'}"
    said = {d.get("prefix_cache") for d in (ctx.decode or {}).values() if isinstance(d, dict)}
    if "off" in said:
        return "the service runs with --no-prefix-cache (every prompt is prefilled from its first token): " \
               "serve without that flag to check prefix reuse"
    return None


@case("prefix_reuse", "a conversation's follow-up reuses the first turn (usage.prompt_tokens_details."
      "cached_tokens > 0) and answers token for token as the same prompt on a cold cache", group=F,
      timeout_s=300, applicable=_prefix_applicable)
def prefix_reuse(ctx: Context) -> Outcome:
    """Proves: (1) the follow-up prefilled only what the first turn did not cover (cached_tokens, as the
    service reports it, covers the first turn's prompt); (2) its greedy answer equals the answer of the
    same prompt sent after one unrelated request per sequence slot (each slot keeps one sequence's state, so
    that run can reuse only what the unrelated prompts share at their start, a BOS token, which its
    cached_tokens must show: a cold prefill by the service's own account) and, with the weights here in float32, the answer
    of a fresh TP1 run with no cache; (3) the same prompt again reuses its work and answers the same."""
    o = Outcome()
    post = lambda prompt, n=TURN_TOKENS: ctx.client.post("/v1/completions", ctx.payload(prompt, n))  # noqa: E731
    first = post(TURN_1)
    if not o.check(first.ok, f"the first turn answered {first.status}: {first.error_message()}"):
        return o
    follow = TURN_1 + first.text() + FOLLOW_UP
    warm = post(follow)
    if not o.check(warm.ok, f"the follow-up answered {warm.status}: {warm.error_message()}"):
        return o
    # One unrelated request per sequence slot, one after another: each takes the slot that ended longest ago
    # (none of them reuses another's prompt), so the last one overwrites the conversation's slot.
    from v100plan.accept.concurrency import served_concurrency  # here: its cases register after these

    slots = served_concurrency(ctx)["max_concurrency"] or 1
    evicts = [post(f"{OPENERS[i % len(OPENERS)]} {i // len(OPENERS) or ''} {UNRELATED}".replace("  ", " "), 4)
              for i in range(slots)]
    evict = min(evicts, key=lambda a: _prompt_tokens(a) or 0)
    cold = post(follow)
    again = post(follow)
    if not o.check(all(e.ok for e in evicts) and cold.ok and again.ok,
                   f"a request answered {[e.status for e in evicts]}/{cold.status}/{again.status}"):
        return o
    turn1, cached = _prompt_tokens(first), _cached(warm)
    o.metrics.update({"turn_1_prompt_tokens": turn1, "follow_up_prompt_tokens": _prompt_tokens(warm),
                      "follow_up_cached_tokens": cached, "cold_cached_tokens": _cached(cold),
                      "unrelated_prompt_tokens": _prompt_tokens(evict), "unrelated_requests": len(evicts),
                      "repeat_cached_tokens": _cached(again),
                      "follow_up_latency_s": round(warm.elapsed_s, 4), "cold_latency_s": round(cold.elapsed_s, 4)})
    if o.check(cached is not None, "the follow-up's usage has no prompt_tokens_details.cached_tokens"):
        # at least the first turn's prompt less one token (a linear-attention state is kept one token
        # before a prompt's end, engine/core/prefix.py) and never the whole follow-up
        o.check(cached > 0, "the follow-up reused nothing of the first turn (cached_tokens 0)")
        o.check(turn1 is None or cached >= turn1 - 1,
                f"the follow-up reused {cached} tokens, less than the first turn's prompt ({turn1} tokens)")
        o.check(cached < (_prompt_tokens(warm) or cached + 1), "cached_tokens covers the whole follow-up prompt")
    # After the unrelated requests the engine's slots hold theirs only: the follow-up can reuse what the prompts
    # share at their start (a tokenizer's BOS token), never the conversation.
    cold_cached, unrelated = _cached(cold), _prompt_tokens(evict)
    o.check(cold_cached is not None and unrelated is not None and cold_cached < unrelated and
            (turn1 is None or cold_cached < turn1 - 1),
            f"the cold run still reused {cold_cached} tokens after {len(evicts)} unrelated request(s) of "
            f"{unrelated}+ tokens: no cold "
            "answer to compare with")
    o.check(warm.token_ids() == cold.token_ids(), f"the follow-up with its reused prefix answered "
                                                  f"{warm.text()[:60]!r}, the cold prompt {cold.text()[:60]!r}")
    o.check((_cached(again) or 0) > 0, "the same prompt sent again reused nothing")
    o.check(again.token_ids() == cold.token_ids(), "the same prompt sent again answered differently")
    if ctx.refs.exact:
        ref = ctx.refs.get(follow, TURN_TOKENS)
        o.check(ctx.matches(ref, warm.text(), warm.token_ids()),
                f"the follow-up differs from a fresh TP1 run ({ref.source}): {warm.text()[:60]!r} vs {ref.text[:60]!r}")
    o.note("http", f"follow-up: {_prompt_tokens(warm)} prompt tokens, {cached} cached; cold: {_cached(cold)} cached")
    return o


# ----- speculation ------------------------------------------------------------------------------------

def _no_mtp_layer(ctx: Context) -> str | None:
    if not ctx.target.model_dir:
        return None
    try:
        cfg = json.loads((Path(ctx.target.model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    return None if cfg.get("mtp_num_hidden_layers") else "its model has no MTP layer (config.json sets no mtp_num_hidden_layers)"


def _spec_applicable(ctx: Context) -> str | None:
    if not ctx.is_engine:
        return f"needs the bundled engine (its v100plan extension); this server is {ctx.server or 'another make'}"
    found = speculation(ctx)
    if found["on"] is None:
        return "the service does not say whether it speculates (no speculative block in its keyed /health, no " \
               f"{SPEC_DRAFTS} in its /metrics): give accept the API key"
    if not found["on"]:
        no_layer = _no_mtp_layer(ctx)
        return NO_SPEC + (f"; {no_layer}" if no_layer else "")
    return None


def _needs_plain_reference(ctx: Context) -> str | None:
    """Speculation on, and a TP1 run without it (the suite's greedy references) to compare with."""
    return _spec_applicable(ctx) or functional.needs_exact_tp1(ctx)


@case("spec_equals_plain", "with MTP speculation on, every greedy answer equals one-token decoding's (a TP1 "
      "run without speculation) token for token, and the ranks did draft", group=F, timeout_s=300,
      applicable=_needs_plain_reference)
def spec_equals_plain(ctx: Context) -> Outcome:
    o = Outcome()
    before = spec_counters(ctx)
    asked = [(key, p, REF_TOKENS) for key, p in PROMPTS.items()] + [("story_32", PROMPTS["story"], 32)]
    for key, prompt, n in asked:
        ref = ctx.refs.get(prompt, n)
        a = ctx.client.post("/v1/completions", ctx.payload(prompt, n))
        if o.check(a.ok, f"{key}: answered {a.status}: {a.error_message()}"):
            o.check(ctx.matches(ref, a.text(), a.token_ids()),
                    f"{key}: speculative {a.token_ids()} vs one-token decoding {ref.token_ids}")
    after = spec_counters(ctx)
    o.metrics["prompts"] = len(asked)
    if before is not None and after is not None:
        drafted, accepted = after[0] - before[0], after[1] - before[1]
        o.metrics.update({"draft_tokens": int(drafted), "accepted_tokens": int(accepted),
                          "acceptance_rate": round(accepted / drafted, 4) if drafted else None})
        o.check(drafted > 0, f"{SPEC_DRAFTS} did not grow over {len(asked)} greedy requests: nothing was drafted")
    else:
        o.warn(f"/metrics has no {SPEC_DRAFTS}: that the ranks drafted is not shown")
    block = health_block(ctx)
    if block is not None:  # what /health says since the service started (metrics are flat values)
        o.metrics.update({f"health_{k}": block.get(k) for k in ("mode", "drafted_tokens", "acceptance_rate")})
    return o


# ----- a fault during speculation ---------------------------------------------------------------------

_KILL_RANK1 = next(sc for sc in SCENARIOS if sc.key == "kill_rank1")


def _spec_fault_applicable(ctx: Context) -> str | None:
    return _needs_control(ctx) or _spec_applicable(ctx)


@case("spec_fault", "SIGKILL rank 1 while a speculative stream runs: the stream ends with an error event, no "
      "token differs from the fault-free greedy answer, the pair comes back and still drafts", group="fault",
      timeout_s=_timeout, applicable=_spec_fault_applicable)
def spec_fault(ctx: Context) -> Outcome:
    o = _run_fault(ctx, _rank_action(_KILL_RANK1.action, _KILL_RANK1.rank),
                   log_check=_failure_cause(*(c.value for c in _KILL_RANK1.detected_by)))
    # the first exact answer after each recovery came from the new pair: it must speculate too
    before = spec_counters(ctx)
    a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["fox"], REF_TOKENS))
    after = spec_counters(ctx)
    if before is not None and after is not None:
        o.check(a.ok and after[0] > before[0], "the restarted pair does not draft: speculation was lost in the restart")
        o.metrics["drafts_after_recovery"] = int(after[0] - before[0])
    return o
