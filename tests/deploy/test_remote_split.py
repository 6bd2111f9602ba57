"""The local split a deploy uploads: made once per model (cached by its files' SHA-256), the same bytes
every time, made again when the cache no longer holds what it wrote, and pinned by the release id."""

from __future__ import annotations

import json

import pytest

from tests import engine_helpers
from v100plan.errors import BadInput
from v100plan.remote import release as rel
from v100plan.remote import split

demo_dir = engine_helpers.demo_dir


def test_a_model_is_split_once_and_a_damaged_cache_is_split_again(demo_dir, _isolated_home):
    source = rel.model_files(demo_dir)
    assert split.cached(source) is None and not (_isolated_home / "shards").exists()  # looking writes nothing

    first = split.split(demo_dir, source)
    assert not first.cached and first.dir == _isolated_home / "shards" / f"{rel.model_digest(source)}-tp2"
    assert sorted(first.files) == ["rank0/config.json", "rank0/model.safetensors", "rank0/tokenizer.json",
                                   "rank0/tokenizer_config.json", "rank1/config.json", "rank1/model.safetensors",
                                   "rank1/tokenizer.json", "rank1/tokenizer_config.json", "shard.json"]
    assert first.bytes_per_rank[0] == first.bytes_per_rank[1] > 0
    man = json.loads((first.dir / "shard.json").read_text())
    assert str(demo_dir) not in json.dumps(man) and rel.model_digest(source) in man["source"]
    assert "split into 2 shards locally" in first.sentence()

    again = split.split(demo_dir, source)
    assert again.cached and again.files == first.files and "nothing split" in again.sentence()

    w = first.dir / "rank0" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    assert split.cached(source) is None  # the cache no longer holds what the split wrote
    remade = split.split(demo_dir, source)
    assert not remade.cached and remade.files == first.files  # split again, into the same bytes


def test_the_release_id_follows_the_split(demo_dir):
    source = rel.model_files(demo_dir)
    shards = split.split(demo_dir, source).files
    settings = rel.EngineSettings()

    def rid(files, sharding):
        return rel.release_id(rel.manifest("b" * 64, "venv", ["torch==2"], settings, files, sharding))

    base = rid(shards, {"tp": 2, "source": rel.model_digest(source)})
    assert base == rid(shards, {"tp": 2, "source": rel.model_digest(source)})
    assert base != rid(shards, {"tp": 4, "source": rel.model_digest(source)})  # another sharding
    assert base != rid(source, None)  # the unsplit checkpoint
    other = {**shards, "rank1/model.safetensors": {**shards["rank1/model.safetensors"], "sha256": "0" * 64}}
    assert base != rid(other, {"tp": 2, "source": rel.model_digest(source)})  # other shard bytes


def test_a_model_that_does_not_divide_is_refused(tmp_path):
    src = tmp_path / "odd"
    src.mkdir()
    raw = engine_helpers.small_config("llama-3.1-8b")
    raw.update(num_attention_heads=3, num_key_value_heads=3, hidden_size=96)
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BadInput) as caught:
        split.split(src, rel.model_files(src))
    assert "could not be split into 2 tensor-parallel shards" in caught.value.message
    assert "num_attention_heads = 3 is not divisible by 2" in caught.value.message
    assert [p.name for p in (split.home() / "shards").iterdir()] == []  # nothing half-made left in the cache


def test_a_cache_whose_copies_differ_from_the_source_is_split_again(demo_dir):
    """The record beside the cache is not the judge: a rank's config that is not the source's (the record
    recomputed to match it) is not reused; an extra file in a rank's folder neither."""
    source = rel.model_files(demo_dir)
    first = split.split(demo_dir, source)
    cfg = first.dir / "rank0" / "config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"planted": 1, ', 1))
    (first.dir / split.RECORD).write_text(json.dumps(rel.hash_files(first.dir)))
    assert split.cached(source) is None
    again = split.split(demo_dir, source)
    assert not again.cached and again.files == first.files
    (again.dir / "rank1" / "extra.py").write_text("print('planted')\n")
    (again.dir / split.RECORD).write_text(json.dumps(rel.hash_files(again.dir)))
    assert split.cached(source) is None
