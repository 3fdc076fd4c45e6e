"""Training data from prompt records: follow-up turns answered over the target's first
answer, responses at a mix of temperatures, and self-instruct prompts that carry categories."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from specrun.models.tokenizer import Tokenizer
from specrun.runtime.distill.broad_prompts import CATEGORIES, PromptRecord
from specrun.runtime.distill.data import (
    encode_prompts,
    generate_record_sequences,
    generate_sequences,
    response_temperatures,
)
from specrun.runtime.distill.self_instruct import self_instruct_records
from tiny_models import random_llama, tiny_config

# Every turn's content, then "t1" after each user turn (the generation prompt).
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% if m['role'] == 'user' %}t1 {% endif %}"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(), seed=0)


def _tokenizer(*, chat_template: str | None = TEMPLATE) -> Tokenizer:
    vocab = {f"t{i}": i for i in range(97)}
    backend = Backend(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, special_tokens={}, chat_template=chat_template)


RECORDS = [
    PromptRecord("t5 t17 t3", "math", follow_up="t8 t9"),
    PromptRecord("t60 t2", "coding"),
    PromptRecord("t44 t45 t46 t47", "stem", follow_up="t30"),
]


def test_follow_ups_are_answered_over_the_first_answer(target):
    tokenizer = _tokenizer()
    options = {"max_new_tokens": 4, "seed": 5, "batch_size": 8}
    sequences = generate_record_sequences(target, tokenizer, RECORDS, **options)
    encoded = encode_prompts([r.prompt for r in RECORDS], tokenizer)
    first = generate_sequences(target, encoded, **options)
    assert [sequences[i] for i in (0, 2, 3)] == first
    conversations = []
    for record, answer in ((RECORDS[0], first[0]), (RECORDS[2], first[2])):
        reply = tokenizer.decode(answer.token_ids[answer.num_prompt :])
        text = f"{record.prompt} t1 {reply} {record.follow_up} t1 "
        conversations.append(tokenizer.encode(text, add_special_tokens=False))
    # Greedy: each second answer is the target's answer to its conversation alone.
    assert [sequences[1], sequences[4]] == generate_sequences(target, conversations, **options)
    untemplated = generate_record_sequences(target, _tokenizer(chat_template=None), RECORDS,
                                            **options)  # fmt: skip
    # No chat template: the prompts encoded raw, their follow-ups skipped.
    assert [seq.num_prompt for seq in untemplated] == [3, 2, 4]


def test_response_temperatures_mix_greedy_and_sampled_answers(target):
    assert response_temperatures(5, [0, 1]) == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert response_temperatures(4, [0, 0, 1]) == [0.0, 0.0, 1.0, 0.0]
    for bad in ([], [0, -1]):
        with pytest.raises(ValueError, match="temperatures"):
            response_temperatures(3, bad)
    prompts = [[5, 17, 3, 8], [60, 2, 9], [44, 45, 46], [7, 7, 7, 7]]
    options = {"max_new_tokens": 5, "seed": 3, "batch_size": 4}
    mixed = generate_sequences(target, prompts, temperature=[0, 1, 0, 1], **options)
    greedy = generate_sequences(target, prompts, temperature=0.0, **options)
    sampled = generate_sequences(target, prompts, temperature=1.0, **options)
    assert [mixed[0], mixed[2]] == [greedy[0], greedy[2]]
    assert [mixed[1], mixed[3]] == [sampled[1], sampled[3]]
    assert [mixed[1], mixed[3]] != [greedy[1], greedy[3]]
    with pytest.raises(ValueError, match="3 temperatures for 4 prompts"):
        generate_sequences(target, prompts, temperature=[0, 1, 0], max_new_tokens=2)


def test_self_instruct_records_carry_their_categories(target):
    words = ["<unk>", *(chr(97 + i % 26) + chr(97 + i // 26) + "ndor" for i in range(96))]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend, special_tokens={})
    options = {"num_prompts": 6, "seed": 2, "max_new_tokens": 4}
    records = self_instruct_records(target, tokenizer, categories=CATEGORIES[:3], **options)
    assert 0 < len(records) <= 6 and len({r.prompt for r in records}) == len(records)
    assert {r.category for r in records} <= set(CATEGORIES[:3])
    plain = self_instruct_records(target, tokenizer, **options)
    assert plain and all(r.category is None for r in plain)
    for bad in ((), ("poetry",)):
        with pytest.raises(ValueError, match="categories"):
            self_instruct_records(target, tokenizer, categories=bad, **options)
