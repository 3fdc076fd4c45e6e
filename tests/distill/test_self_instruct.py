"""Self-instruct prompts: topics from the vocabulary (never the held-out split's words), the
model's lines cleaned and deduplicated, reproducible under a seed."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from specrun.models.tokenizer import Tokenizer
from specrun.runtime.distill.prompts import builtin_prompts, heldout_words
from specrun.runtime.distill.self_instruct import (
    clean_prompt,
    self_instruct_prompts,
    vocabulary_topics,
)
from tiny_models import random_llama, tiny_config

WORDS = ["<unk>", "Apple", "ab", "t5", "river", "gardening", "lighthouses", "volcano", "moun"]
WORDS += [f"w{i}" for i in range(97 - len(WORDS) - 40)]
WORDS += [chr(97 + i % 26) + chr(97 + i // 26) + "ndor" for i in range(40)]


def _tokenizer(vocab: list[str]) -> Tokenizer:
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, special_tokens={}, chat_template=None, eos_token_ids=[])


def test_topics_are_whole_lower_case_words_outside_the_heldout_split():
    topics = vocabulary_topics(_tokenizer(WORDS), exclude=heldout_words())
    assert "river" in topics and "volcano" in topics
    assert not {"Apple", "ab", "t5", "moun"} & set(topics)  # case, length, letters only
    assert not {"gardening", "lighthouses"} & set(topics)  # held-out subjects
    assert topics == sorted(topics)


def test_marked_vocabularies_take_word_starts_only():
    vocab = ["<unk>", "\u0120river", "ation", "\u0120volcano", "ization"]
    assert vocabulary_topics(_tokenizer(vocab)) == ["river", "volcano"]


def test_heldout_words_cover_every_heldout_prompt():
    words = heldout_words()
    for prompt in builtin_prompts("heldout")[:10]:
        assert any(w.strip("?.,!").lower() in words for w in prompt.split())


def test_clean_prompt_keeps_the_first_usable_line():
    assert clean_prompt('\n  "How do volcanoes form?"\nMore text') == "How do volcanoes form?"
    assert clean_prompt("Why?") is None
    assert clean_prompt("Here is a task about the task:") is None
    assert clean_prompt("x" * 400) is None


def test_self_instruct_prompts_are_distinct_and_reproducible():
    target = random_llama(tiny_config(), seed=0)
    tokenizer = _tokenizer(WORDS)
    first = self_instruct_prompts(target, tokenizer, num_prompts=12, seed=3, max_new_tokens=6)
    again = self_instruct_prompts(target, tokenizer, num_prompts=12, seed=3, max_new_tokens=6)
    assert first == again
    assert 0 < len(first) <= 12 and len(set(first)) == len(first)
    assert all(clean_prompt(p) == p for p in first)
    with pytest.raises(ValueError, match="num_prompts"):
        self_instruct_prompts(target, tokenizer, num_prompts=-1)
