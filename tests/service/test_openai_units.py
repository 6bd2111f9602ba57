"""The OpenAI API's pure parts, without processes: the sampling controls against transformers' logits processors on
the same logits, chat templates (sources, sandbox, errors, equality with transformers' rendering), the tool-call
parser on outputs in the Qwen family's formats, reasoning / content / tool-call splitting of a stream, the grammar
mask, and the request schema's refusals."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from engine.core import chat_template, logits_processors, tool_calls
from engine.core.logits_processors import Processing
from engine.core.sampling import Sampler
from engine.service.app_schemas import ChatRequest, CompletionRequest
from engine.service.chat_output import ChatOutput, prompt_opens_reasoning
from tests.test_service_support import demo_model

V = 64


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


# ----- sampling against transformers' processors -------------------------------------------------


def test_penalties_and_bias_equal_transformers_and_openai_formula():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(1)
    prompt, output = [3, 5, 7, 5], [9, 9, 11, 3]
    p = Processing(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4,
                   logit_bias=((2, 5.0), (4, -100.0)), prompt_ids=tuple(prompt))
    history = logits_processors.History(p, V)
    for t in output:
        history.add(t)
    got = logits_processors.adjust(logits, p, history)
    ref = logits.clone()
    ref[2] += 5.0
    ref[4] -= 100.0
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), ref.unsqueeze(0))[0]
    for tok in set(output):  # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence
        ref[tok] -= output.count(tok) * 0.4 + 0.7
    assert torch.allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("top_k, top_p, min_p, temperature", [(5, 1.0, 0.0, 0.8), (0, 1.0, 0.2, 1.0),
                                                              (10, 0.9, 0.05, 1.3), (1, 1.0, 0.0, 1.0)])
def test_top_k_top_p_min_p_keep_what_transformers_keeps(top_k, top_p, min_p, temperature):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = _logits(2)
    sampler = Sampler(temperature, top_p, 0, processing=Processing(top_k=top_k, min_p=min_p))
    probs = sampler.probs(logits)
    ids, scores = torch.zeros(1, 1, dtype=torch.long), logits.unsqueeze(0)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    ref = torch.softmax(scores[0], -1)
    assert torch.equal(probs > 0, ref > 0)  # the same tokens survive
    assert torch.allclose(probs / probs.sum(), ref, atol=1e-6)


def test_greedy_follows_the_bias_and_logprobs_are_the_raw_distribution():
    logits = _logits(3)
    forced = int(torch.argmin(logits))
    sampler = Sampler(0.0, processing=Processing(logit_bias=((forced, 100.0),), logprobs=3))
    assert not sampler.plain
    assert sampler(logits) == forced
    chosen, top = sampler.logprobs
    raw = torch.log_softmax(logits, -1)
    assert math.isclose(chosen, float(raw[forced]), rel_tol=1e-6)
    assert [i for i, _ in top] == torch.topk(raw, 3).indices.tolist()
    top1 = Sampler(1.0, seed=5, processing=Processing(top_k=1))
    assert all(top1(_logits(s)) == int(torch.argmax(_logits(s))) for s in range(10))


def test_processing_from_message_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="unknown sampling fields"):
        Processing.from_message({"top_q": 3})
    with pytest.raises(ValueError, match="finite"):
        Processing.from_message({"min_p": float("nan")})


# ----- chat templates ---------------------------------------------------------------------------

# A small template in the Qwen3.5 family's format (written for these tests): tools in <tools>, tool answers in
# <tool_response>, a thinking switch, and two branches that misbehave on purpose.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.content == 'boom' %}{{ raise_exception('boom is not a question') }}{% endif %}"
    "{%- if m.content == 'pwn' %}{{ cycler.__init__.__globals__.os.system('touch ' ~ m.name) }}{% endif %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{%- for k, v in c.function.arguments | items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"},
                                               "metric": {"type": "boolean"}}}}}]


def test_template_sources_in_order(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}))
    src = chat_template.find(tmp_path)
    assert src.origin == "tokenizer_config.json" and src.pick(False) == "D" and src.pick(True) == "T"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat_template.find(tmp_path).pick(True) == "J"
    override = tmp_path / "mine.jinja"
    override.write_text("M")
    assert chat_template.find(tmp_path, str(override)).pick(False) == "M"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert chat_template.find(tmp_path) is None


def test_template_runs_sandboxed_and_its_errors_say_what_it_said(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(chat_template.TemplateError, match="sandbox forbids"):
        chat_template.render(QWEN_LIKE, [{"role": "user", "content": "pwn", "name": str(marker)}])
    assert not marker.exists()
    with pytest.raises(chat_template.TemplateError, match="boom is not a question"):
        chat_template.render(QWEN_LIKE, [{"role": "user", "content": "boom"}])
    with pytest.raises(chat_template.TemplateError, match="does not compile"):
        chat_template.check("{% for %}")


def test_rendering_equals_transformers_apply_chat_template():
    from transformers import PreTrainedTokenizerFast

    from engine.core.tokenizer import Tokenizer

    model = demo_model()
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model, "tokenizer.json"))
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    ours = chat_template.render(QWEN_LIKE, messages, tools=TOOLS, extra={"enable_thinking": False})
    ref = hf.apply_chat_template(messages, tools=TOOLS, chat_template=QWEN_LIKE, tokenize=False,
                                 add_generation_prompt=True, enable_thinking=False)
    assert ours == ref and ours.endswith("</think>") and "<tool_response>\nsunny" in ours
    assert Tokenizer(model).render_chat([{"role": "user", "content": "hi"}]) == "<|user|>hi<|end|>\n<|assistant|>"


# ----- tool calls and reasoning -----------------------------------------------------------------

# Answers in the family's formats, as the models write them (Qwen3.5 / Qwen3-Coder XML; Qwen3 Hermes JSON).
XML_ANSWER = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n"
              "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
              "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
              "</function>\n</tool_call>")
HERMES_ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>'


def test_tool_call_parser_reads_both_formats():
    content, calls = tool_calls.split(XML_ANSWER, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True}),
        ("get_weather", {"city": "line one\nline two"})]
    content, calls = tool_calls.split(HERMES_ANSWER, TOOLS)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Rome", "days": 1}
    # no closing tags on the parameter (seen in the wild): it ends at </function>
    _, calls = tool_calls.split("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>",
                                TOOLS)
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    # broken: kept as content, nothing lost
    assert tool_calls.split("<tool_call>\n{not json}\n</tool_call>", TOOLS) == (
        "<tool_call>\n{not json}\n</tool_call>", [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_split_equals_the_whole(step):
    text = "thinking about it</think>\n\n" + XML_ANSWER
    out = ChatOutput(reasoning="open", tools=TOOLS)
    deltas = []
    for i in range(0, len(text), step):
        deltas += out.feed(text[i:i + step])
    deltas += out.finish()
    msg = out.message()
    assert msg["reasoning_content"] == "thinking about it" and msg["content"] == "Let me check.\n\n"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_weather"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "thinking about it"
    assert not any("<" in d.get("content", "") for d in deltas)  # no half tags in content
    assert sum(len(d.get("tool_calls", [])) for d in deltas) == 2


def test_reasoning_opened_by_the_answer_or_the_prompt():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = ChatOutput(reasoning="detect")
    out.feed("<thi")
    out.feed("nk>\nhmm</think>\n\nYes.")
    out.finish()
    assert out.message() == {"role": "assistant", "content": "Yes.", "reasoning_content": "hmm"}
    plain = ChatOutput(reasoning="none")
    plain.feed("<think>x</think>y")
    plain.finish()
    assert plain.message()["content"] == "<think>x</think>y"


# ----- grammar ----------------------------------------------------------------------------------


def test_grammar_mask_makes_random_logits_valid_json():
    import jsonschema

    from engine.core import grammar

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
              "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["city", "days", "ok"],
              "additionalProperties": False}
    compiler = grammar.compiler_for(demo_model())
    from engine.core.tokenizer import Tokenizer

    tok = Tokenizer(demo_model())
    for seed in range(3):
        c = grammar.Constraint(compiler, {"kind": "json_schema", "schema": json.dumps(schema)})
        sampler = Sampler(1.0, seed=seed, constraint=c)
        gen, out = torch.Generator().manual_seed(seed), []
        for _ in range(200):
            t = sampler(torch.randn(256, generator=gen) * 4)
            if t in tok.eos_ids:
                break
            out.append(t)
        jsonschema.validate(json.loads(tok.decode(out)), schema)
    with pytest.raises(grammar.GrammarError):
        grammar.check_spec({"kind": "json_schema", "schema": "{\"type\": 5}"})


# ----- the request schema -----------------------------------------------------------------------


def _chat(**kw):
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_schema_takes_integral_floats_and_refuses_by_name():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": 1.0, "max_tokens": 4.0}).n == 1
    assert _chat(frobnicate=1).unsupported()[0] == "frobnicate"
    assert _chat(n=2).unsupported()[0] == "n"
    assert _chat(audio={"voice": "x"}).unsupported()[0] == "audio"
    assert _chat(store=True).unsupported()[0] == "store"
    assert _chat(top_logprobs=2).unsupported()[0] == "top_logprobs"
    assert _chat(logit_bias={"x": 1}).unsupported()[0] == "logit_bias"
    assert _chat(tool_choice="required").unsupported()[0] == "tool_choice"
    assert _chat(stream_options={"include_usage": True}).unsupported()[0] == "stream_options"
    # vLLM's continuous_usage_stats (guidellm sends it): taken, and counts only with include_usage
    both = _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert both.unsupported() is None and both.continuous_usage()
    assert not _chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage()
    assert _chat(stream=True, stream_options={"continuous_usage": True}).unsupported()[0] == \
        "stream_options.continuous_usage"
    bad = ChatRequest.model_validate({"model": "m", "messages": [{"role": "tool", "content": "x"}]})
    assert bad.unsupported()[0] == "messages.0.tool_call_id"
    ok = _chat(user="u", metadata={"a": "b"}, service_tier="auto", logprobs=True, top_logprobs=3, top_k=5,
               tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert ok.unsupported() is None and ok.top_logprobs_count() == 3
