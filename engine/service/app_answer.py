"""One answer on its way out: rank 0's tokens -> text (TextAssembler: stop strings), the chat parts
(ChatOutput: reasoning, content, tool calls), log-probabilities, and the OpenAI bodies and stream chunks.

A stream sends one chunk per token as soon as both ranks agreed on it (with the token id in the
``v100plan`` extension); a token whose text is held back (a possible stop string, half a tag) sends
an empty delta.
"""

from __future__ import annotations

from engine.service.chat_output import ChatOutput
from engine.service.proxy_jobs import Job
from engine.service.proxy_text import ModelText, TextAssembler


class Answer:
    def __init__(self, kind: str, rid: str, created: int, text: ModelText, assembler: TextAssembler, job: Job,
                 output: ChatOutput | None = None, logprobs: bool = False):
        self.kind, self.rid, self.created, self.text = kind, rid, created, text
        self.assembler, self.job, self.output, self.want_logprobs = assembler, job, output, logprobs
        self.entries: list[dict] = []     # chat logprobs entries (or completion ones), one per token
        self.offset = 0                   # completions' text_offset of the next token

    # ----- tokens -------------------------------------------------------------------------------

    def token(self, token_id: int, logprobs: list | None) -> list[dict] | None:
        """Feed rank 0's next token; the stream chunks it gives (None once a stop string ended the text)."""
        after_stop = self.assembler.stopped
        delta = self.assembler.add(token_id)
        if self.assembler.stopped:
            self.job.cancel("stop")
        if after_stop:
            return None
        entry = self._entry(token_id, logprobs) if self.want_logprobs and logprobs is not None else None
        deltas = self._split(delta)
        chunks = [self.chunk(d, None) for d in deltas] or [self.chunk({} if self.kind == "chat" else "", None)]
        chunks[0]["v100plan"] = {"token_ids": [token_id]}
        if entry is not None:
            chunks[0]["choices"][0]["logprobs"] = self._logprobs([entry])
        return chunks

    def finish(self) -> list[dict]:
        """What was held back, as chunks (before the last one)."""
        delta = self.assembler.flush()
        deltas = self._split(delta)
        if self.output is not None:
            deltas += self.output.finish()
        return [self.chunk(d, None) for d in deltas]

    def finish_reason(self, rank_reason: str) -> str:
        if self.output is not None and self.output.calls and rank_reason != "length":
            return "tool_calls"
        if self.assembler.stopped or self.job.cancel_reason == "stop":
            return "stop"
        return rank_reason

    def _split(self, delta: str) -> list:
        if self.kind != "chat":
            return [delta] if delta else []
        if self.output is None:
            return [{"content": delta}] if delta else []
        return self.output.feed(delta) if delta else []

    # ----- bodies -------------------------------------------------------------------------------

    def chunk(self, delta, reason: str | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta if delta is not None else {}, "finish_reason": reason,
                      "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.text.model_id,
                "choices": [choice]}

    def running_usage(self, chunk: dict, continuous: bool) -> dict:
        """vLLM's continuous_usage_stats: the chunk carries the tokens so far (the last chunks carry the
        ranks' final usage)."""
        if continuous:
            prompt, done = len(self.job.params.prompt_ids), len(self.assembler.ids)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        return chunk

    def last_chunk(self, reason: str, usage: dict) -> dict:
        last = self.chunk(None, reason)
        last["usage"] = usage_body(usage)
        last["v100plan"] = self.extension()
        return last

    def body(self, reason: str, usage: dict) -> dict:
        logprobs = self._logprobs(self.entries) if self.want_logprobs else None
        if self.kind == "chat":
            message = self.output.message() if self.output is not None else {"role": "assistant",
                                                                              "content": self.assembler.emitted}
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.assembler.emitted, "finish_reason": reason, "logprobs": logprobs}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.text.model_id,
                "choices": [choice], "usage": usage_body(usage), "v100plan": self.extension()}

    def extension(self) -> dict:
        """Beyond OpenAI's schema: what the acceptance suite needs to check an answer exactly."""
        return {"token_ids": list(self.assembler.ids), "seed": self.job.params.seed,
                "generation": self.job.generation}

    # ----- log-probabilities --------------------------------------------------------------------

    def _entry(self, token_id: int, logprobs: list) -> dict:
        chosen, top = logprobs
        entry = {"token": self._piece(token_id), "logprob": chosen, "id": token_id,
                 "top": [(self._piece(i), lp) for i, lp in top]}
        self.entries.append(entry)
        return entry

    def _piece(self, token_id: int) -> str:
        tok = self.text.tokenizer
        return tok.decode([token_id], skip_special=False) if tok is not None else str(token_id)

    def _logprobs(self, entries: list[dict]) -> dict:
        if self.kind == "chat":
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                                  for t, lp in e["top"]]} for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": offsets}


def usage_body(usage: dict) -> dict:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens") or 0)}}
