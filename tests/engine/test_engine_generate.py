"""`python -m engine generate`: the one-shot contract, and TP2 (two rank processes) against TP1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine.core.tokenizer import Tokenizer
from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir
PROMPT = "Hello there, the world!\n"


def gen(model, *args, expect_rc=0):
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), *map(str, args)],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == expect_rc, r.stderr[-3000:]
    return r


def last_json(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp1(demo_dir):
    return last_json(gen(demo_dir, "--prompt", PROMPT, "--max-tokens", 40, "--json"))


def test_contract_exactly_n_generated_tokens_and_text(tp1, demo_dir):
    assert set(tp1) == {"token_ids", "text", "weights"}
    assert tp1["weights"]["format"] == "float32" and tp1["weights"]["packed_matrices"] == 0
    assert len(tp1["token_ids"]) == 40
    assert tp1["text"] == Tokenizer(demo_dir).decode(tp1["token_ids"])


def test_prompt_ids_are_verbatim_and_prompt_gets_bos(tp1, demo_dir):
    ids = Tokenizer(demo_dir).encode(PROMPT)
    assert ids[0] == 1  # the demo's BOS rule
    same = last_json(gen(demo_dir, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", 40, "--json"))
    assert same["token_ids"] == tp1["token_ids"]
    without_bos = last_json(gen(demo_dir, "--prompt-ids", ",".join(map(str, ids[1:])), "--max-tokens", 40, "--json"))
    assert without_bos["token_ids"] != tp1["token_ids"]  # verbatim: no BOS was added


def test_directory_without_tokenizer_takes_ids_only(demo_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(demo_dir / f, bare / f)
    out = last_json(gen(bare, "--prompt-ids", "1,50,60", "--max-tokens", 5, "--json"))
    assert out["text"] is None and len(out["token_ids"]) == 5
    r = gen(bare, "--prompt", "hi", "--max-tokens", 5, "--json", expect_rc=2)
    assert "no tokenizer.json" in r.stderr and "--prompt-ids" in r.stderr


def test_stop_at_eos_may_end_early_and_sampling_uses_the_seed(demo_dir):
    a = last_json(gen(demo_dir, "--prompt", "a", "--max-tokens", 30, "--temperature", 1.5, "--seed", 3, "--json"))
    b = last_json(gen(demo_dir, "--prompt", "a", "--max-tokens", 30, "--temperature", 1.5, "--seed", 3, "--json"))
    c = last_json(gen(demo_dir, "--prompt", "a", "--max-tokens", 30, "--temperature", 1.5, "--seed", 4, "--json"))
    assert a == b and a != c
    eos = last_json(gen(demo_dir, "--prompt-ids", "1,50", "--max-tokens", 400, "--stop-at-eos",
                        "--temperature", 5.0, "--seed", 1, "--json"))
    ids = eos["token_ids"]
    assert len(ids) == 400 or ids[-1] in (2, 7)


@pytest.mark.parametrize("path", ["gloo", "host_mailbox"])
def test_tp2_produces_tp1_tokens(tp1, demo_dir, path):
    r = gen(demo_dir, "--tp", 2, "--allreduce", path, "--prompt", PROMPT, "--max-tokens", 40, "--json")
    assert f"allreduce {path}" in r.stderr
    two = last_json(r)
    assert {k: two[k] for k in ("token_ids", "text")} == {k: tp1[k] for k in ("token_ids", "text")}
    assert two["weights"]["bytes"] < tp1["weights"]["bytes"]  # rank 0 holds its half of the split tensors


def test_bad_prompt_ids_are_refused(demo_dir):
    r = gen(demo_dir, "--prompt-ids", "1,x", "--max-tokens", 3, expect_rc=2)
    assert "comma-separated integers" in r.stderr
    r = gen(demo_dir, "--prompt-ids", "1,9999", "--max-tokens", 3, expect_rc=2)
    assert "outside the vocabulary" in r.stderr


def test_tp2_start_failure_exits_1_with_the_reason(demo_dir):
    r = gen(demo_dir, "--tp", 2, "--allreduce", "device_mailbox", "--prompt-ids", "1,2", "--max-tokens", 2,
            expect_rc=1)
    assert "the ranks did not start" in r.stderr and "device mailbox needs CUDA" in r.stderr


def test_batch_answers_each_request_as_a_run_of_its_own(tp1, demo_dir, tmp_path):
    # One model and one cache for the whole batch (the acceptance suite's references): a short request
    # first must not leave a cache too small for a longer one after it (on a GPU the decode graphs are
    # captured once over that cache), and every answer equals the one-shot run of the same request.
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": "Hi", "max_tokens": 3}) + "\n" +
                     json.dumps({"prompt": PROMPT, "max_tokens": 40}) + "\n")
    docs = [json.loads(line) for line in gen(demo_dir, "--batch", batch).stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 2 and len(docs[0]["token_ids"]) == 3
    assert docs[1]["token_ids"] == tp1["token_ids"]
    short = last_json(gen(demo_dir, "--prompt", "Hi", "--max-tokens", 3, "--json"))
    assert docs[0]["token_ids"] == short["token_ids"]
