"""`python -m engine generate --image`: a prompt with an image through the generate path at TP1 and at TP2 (two
rank processes, each with its own replicated tower), judged against transformers'
Qwen3_5ForConditionalGeneration on the vision demo's weights and the same processor output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.core.tokenizer import Tokenizer
from engine.vision import config as vconfig
from engine.vision import serve as vserve
from tests.engine_helpers import REPO
from tests.vision_helpers import hf_greedy, hf_inputs, image, png

PROMPT = "<|user|>see <|vision_start|><|image_pad|><|vision_end|> and say<|end|>\n<|assistant|>"
N = 16


@pytest.fixture(scope="module")
def case(tmp_path_factory, one_thread):
    import transformers

    from engine.vision import demo

    d = tmp_path_factory.mktemp("vision-demo")
    demo.make(d)
    img = image(150, 90, 3)
    f = d / "picture.png"
    f.write_bytes(png(img))
    vcfg = vconfig.load(d)
    ids = vserve.expand_prompt(Tokenizer(d).encode(PROMPT), [f.read_bytes()], vcfg, vconfig.image_rules(d, vcfg))
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(d).eval()
    return d, f, hf_greedy(hf, hf_inputs(vcfg.image_token_id, ids, [img]), N)


def gen(model, *args, expect_rc=0):
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), *map(str, args)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == expect_rc, r.stderr[-3000:]
    return r


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_generate_with_an_image_equals_transformers(case, tp):
    d, f, ref = case
    r = gen(d, "--tp", tp, "--prompt", PROMPT, "--image", f, "--max-tokens", N, "--json")
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == ref


def test_an_image_without_its_pad_token_is_refused_with_the_hint(case):
    d, f, _ = case
    r = gen(d, "--prompt", "no pad here", "--image", f, expect_rc=2)
    assert "0 image-pad token(s)" in r.stderr and "<|image_pad|>" in r.stderr


def test_an_image_for_a_text_only_model_is_refused(tmp_path):
    from engine.core import demo

    demo.make(tmp_path, arch="qwen3_5")
    (tmp_path / "x.png").write_bytes(png(image(64, 64, 1)))
    r = gen(tmp_path, "--prompt", "hi", "--image", tmp_path / "x.png", expect_rc=2)
    assert "no vision_config" in r.stderr
