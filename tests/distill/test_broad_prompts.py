"""The categorised splits: "broad" (held out) and "train-broad" (training), their counts per
category, determinism, and that "broad" shares no template, topic or prompt with any training
source (the other splits, train-broad, self-instruct's instructions and topic words)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from specrun.models.tokenizer import Tokenizer
from specrun.runtime.distill import prompts as p
from specrun.runtime.distill import train_broad_data as data
from specrun.runtime.distill.broad_prompts import BROAD, CATEGORIES, PromptRecord
from specrun.runtime.distill.data import read_prompt_records, read_prompts
from specrun.runtime.distill.self_instruct import (
    CATEGORY_INSTRUCTIONS,
    INSTRUCTIONS,
    vocabulary_topics,
)
from specrun.runtime.distill.train_broad_prompts import expanded_table, slots


def _words(texts) -> list[str]:
    text = " ".join(texts).lower()
    return sorted(set("".join(c if c.isalpha() else " " for c in text).split()))


def test_broad_has_every_category_and_is_deterministic():
    records = read_prompt_records("builtin:broad")
    counts = Counter(r.category for r in records)
    assert set(counts) == set(CATEGORIES) and len(CATEGORIES) == 8
    assert min(counts.values()) >= 20 and len(records) >= 160
    assert len({r.prompt for r in records}) == len(records)
    assert all(r.follow_up is None and "{" not in r.prompt for r in records)
    assert p.builtin_prompt_records("broad", seed=0) == records
    assert p.builtin_prompts("broad") == [r.prompt for r in records]
    reshuffled = p.builtin_prompt_records("broad", seed=1)
    assert reshuffled != records and sorted(reshuffled, key=str) == sorted(records, key=str)
    assert p.builtin_prompt_records("broad", num_prompts=7) == records[:7]


def test_broad_shares_nothing_with_the_training_sources():
    templates = {t for entry in BROAD.values() for t in entry.templates}
    topics = {t for entry in BROAD.values() for t in entry.topics}
    train_tables = (data.TRAIN_BROAD, expanded_table())
    used_templates = {*p._TRAIN_TEMPLATES, *p._HELDOUT_TEMPLATES, *INSTRUCTIONS}
    used_templates |= {*CATEGORY_INSTRUCTIONS.values()}
    used_templates |= {t for table in train_tables for e in table.values() for t in e.templates}
    used_topics = {*p._TRAIN_SUBJECTS, *p._HELDOUT_SUBJECTS}
    used_topics |= {t for table in train_tables for e in table.values() for t in e.topics}
    assert not templates & used_templates
    assert not topics & used_topics
    broad = set(p.builtin_prompts("broad"))
    for split in ("train", "heldout", "train-broad"):
        assert not broad & set(p.builtin_prompts(split)), split


def test_self_instruct_never_takes_a_broad_word_as_its_topic():
    entries = [text for entry in BROAD.values() for text in (*entry.templates, *entry.topics)]
    vocab = ["<unk>", *_words(entries), "zeppelin"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend, special_tokens={})
    assert "transistor" in vocab and "bauhaus" in vocab
    assert vocabulary_topics(tokenizer, exclude=p.heldout_words()) == ["zeppelin"]


def test_train_broad_covers_the_categories_with_lengths_and_follow_ups():
    records = p.builtin_prompt_records("train-broad")
    counts = Counter(r.category for r in records)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 400
    assert len(records) >= 4000 and len({r.prompt for r in records}) == len(records)
    assert all("{" not in r.prompt for r in records)  # every slot filled
    follow_ups = [r for r in records if r.follow_up is not None]
    assert len(follow_ups) == -(-len(records) // 4)
    assert all(r.follow_up in data.FOLLOW_UPS[r.category] for r in follow_ups)
    for forms in data.LENGTH_FORMS.values():
        asked = sum(r.prompt.endswith(forms) for r in records)
        assert len(records) / 4 < asked < len(records) / 2
    assert p.builtin_prompt_records("train-broad", seed=3) != records
    assert set(p.builtin_prompt_records("train-broad", seed=3)) == set(records)
    # Train-broad leaves the "heldout" split alone too.
    assert not {*p._HELDOUT_SUBJECTS, *p._HELDOUT_TEMPLATES} & {
        t for e in data.TRAIN_BROAD.values() for t in (*e.templates, *e.topics)
    }


def test_slot_topics_are_filled_distinctly():
    table = expanded_table()
    assert table == expanded_table()
    for category, entry in data.TRAIN_BROAD.items():
        num_slotted = sum(bool(slots(topic)) for topic in entry.topics)
        assert len(table[category].topics) == len(entry.topics) + 2 * num_slotted
        assert len(set(table[category].topics)) == len(table[category].topics)


def test_prompt_files_carry_categories_and_follow_ups(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "What is a fjord?", "category": "stem"},
        {"prompt_ids": [4, 5], "category": "math"},
        {"prompt": "Write a haiku.", "follow_up": "Now another."},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_prompt_records(path) == [
        PromptRecord("What is a fjord?", "stem"),
        PromptRecord((4, 5), "math"),
        PromptRecord("Write a haiku.", None, "Now another."),
    ]
    assert read_prompts(path) == ["What is a fjord?", [4, 5], "Write a haiku."]
    for bad, match in (
        ({"prompt_ids": [1], "follow_up": "more"}, "follow_up"),
        ({"prompt": "x", "category": 3}, "category"),
        ({"prompt": "x", "category": ""}, "category"),
    ):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=match):
            read_prompt_records(path)
    with pytest.raises(ValueError, match="num_prompts"):
        p.builtin_prompt_records("broad", num_prompts=-1)
