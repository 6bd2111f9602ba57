"""A rank's warm-up request (engine.core.runner.warm_up, run before `ready`): it leaves nothing behind that a
real request could see. With the prefix cache and speculation on (the hybrid MTP demo, CPU), the answers after a
warm-up are those of a model that never ran it, the cache reuses nothing of it, and the decode statistics the
service reports do not count its steps."""

from __future__ import annotations

from engine.core import config as ecfg
from engine.core import runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler


def _load(d) -> Model:
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(256)
    runner.prepare(m, prefix_cache_bytes=1 << 24, spec_tokens=2)
    return m


def test_a_warmed_up_model_answers_as_a_cold_one_and_remembers_nothing_of_it(mtp_demo_dir, one_thread):
    cold, warm = _load(mtp_demo_dir), _load(mtp_demo_dir)
    assert runner.warm_up(warm, 256, spec_tokens=2) > 0
    assert warm.prefix.live == [] and warm.prefix.drafted == [] and not warm.prefix.snaps
    assert warm.prefix.hits == warm.prefix.reused_tokens == 0 and warm.decoder.stats()["steps"] == 0
    # a prompt that starts as the warm-up's did: nothing of it is reused, and the tokens are the cold model's
    vocab = warm.cfg.vocab_size
    prompt = [(31 * i + 7) % vocab for i in range(40)] + [5, 6, 7]
    for temperature, top_p, seed in ((0.0, 1.0, 0), (0.8, 0.9, 11)):
        got = {}
        for name, m in (("cold", cold), ("warm", warm)):
            info: dict = {}
            out, _ = runner.run(m, prompt, 12, Sampler(temperature, top_p, seed), set(), 256, info=info,
                                spec_tokens=2)
            got[name] = out
            if temperature == 0:
                assert info["cached_tokens"] == 0, name
        assert got["warm"] == got["cold"]
        prompt = prompt[:-1] + [9]  # the sampled case: a fresh prompt, cold in both caches


def test_a_context_too_short_for_a_request_is_not_warmed(mtp_demo_dir):
    m = Model(ecfg.load(mtp_demo_dir))
    weights.load_into(m, mtp_demo_dir)
    m.setup_cache(4)
    runner.prepare(m)
    assert runner.warm_up(m, 256) == 0.0
