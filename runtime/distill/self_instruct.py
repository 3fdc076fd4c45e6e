"""Self-instruct prompts: the target writes the questions it is then trained to answer.

A fixed prompt list teaches a head its templates rather than chat (the shipped SmolLM2 head
accepts twice as many tokens on prompts shaped like its training ones as on held-out ones).
This widens the data offline: topics are whole lower-case words drawn from the model's own
vocabulary (tens of thousands for a BPE tokenizer), minus every word of the held-out split;
the model is asked, through its chat template, for one question about each and samples one.
The questions are decoded by the runtime's plain decoder (generate_sequences), so a GPU
compiles one graph for them.

With categories (`self_instruct_records(categories=...)`), topics are dealt to the categories
in turn and each is asked with its category's instruction (CATEGORY_INSTRUCTIONS: a word
problem with numbers for math, a small programming task for coding, a role to play, ...);
every prompt then carries its category.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

from ...models.llama import Llama
from ...models.tokenizer import Tokenizer
from .data import encode_prompts, generate_sequences
from .prompts import PromptRecord, heldout_words

logger = logging.getLogger(__name__)

INSTRUCTIONS = (
    "Write one question a curious person might ask an AI assistant about {topic}. "
    "Reply with the question only.",
    "Write one short task someone might give an AI assistant that involves {topic}. "
    "Reply with the task only.",
    "Write one request for advice about {topic}, as a user would type it to a chatbot. "
    "Reply with the request only.",
)
CATEGORY_INSTRUCTIONS = {
    "writing": "Write one creative writing request about {topic} that a user might give an "
    "AI assistant. Reply with the request only.",
    "roleplay": "Write one request asking an AI assistant to play a character connected to "
    "{topic}. Reply with the request only.",
    "reasoning": "Write one logic puzzle or tricky reasoning question involving {topic}. "
    "Reply with the puzzle only.",
    "math": "Write one math word problem with specific numbers that involves {topic}. "
    "Reply with the problem only.",
    "coding": "Write one small programming task involving {topic}, as a user would ask an AI "
    "assistant. Reply with the task only.",
    "extraction": "Write one request that gives an AI assistant two sentences about {topic} "
    "and asks it to pull out the names, dates or numbers in them. Reply with the request only.",
    "stem": "Write one question a student might ask about a science or engineering idea "
    "related to {topic}. Reply with the question only.",
    "humanities": "Write one question about history, society, economics or philosophy "
    "related to {topic}. Reply with the question only.",
}
MIN_TOPIC_LENGTH = 5
WORD_STARTS = ("\u0120", "\u2581")  # byte-level BPE "Ġ", SentencePiece "▁"
MIN_PROMPT_CHARS = 12
MAX_PROMPT_CHARS = 300


def vocabulary_topics(tokenizer: Tokenizer, *, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Sorted whole words of the vocabulary, at least MIN_TOPIC_LENGTH lower-case letters,
    minus `exclude`. In a vocabulary with word-start markers (byte-level BPE's "Ġ",
    SentencePiece's "▁") only marked tokens count, so word pieces are left out."""
    raw = [tokenizer.backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    marked = any(token.startswith(WORD_STARTS) for token in raw)
    words = (
        token[1:] if token.startswith(WORD_STARTS) else None if marked else token for token in raw
    )
    return sorted({word for word in words if word is not None and _is_topic(word, exclude)})


def _is_topic(word: str, exclude: frozenset[str]) -> bool:
    return (
        len(word) >= MIN_TOPIC_LENGTH and word.isalpha() and word.islower() and word not in exclude
    )


def clean_prompt(text: str) -> str | None:
    """The first non-empty line of a generated question, or None if it is not usable."""
    lines = [line.strip().strip('"').strip() for line in text.splitlines()]
    line = next((line for line in lines if line), "")
    # A line ending in ":" announces a list or a quote rather than asking anything.
    if not MIN_PROMPT_CHARS <= len(line) <= MAX_PROMPT_CHARS or line.endswith(":"):
        return None
    return line


def self_instruct_prompts(
    target: Llama,
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    seed: int = 0,
    temperature: float = 0.8,
    max_new_tokens: int = 48,
    batch_size: int = 64,
    exclude: Sequence[str] = (),
) -> list[str]:
    """Up to `num_prompts` distinct prompts written by `target` (fewer only if the topics run
    out or the model keeps writing unusable lines), reproducible for a given seed.

    Topics are vocabulary words not in the held-out splits nor in `exclude`; each is paired
    with one of INSTRUCTIONS and the answer is sampled at `temperature`.
    """
    records = self_instruct_records(
        target, tokenizer, num_prompts=num_prompts, seed=seed, temperature=temperature,
        max_new_tokens=max_new_tokens, batch_size=batch_size, exclude=exclude,
    )  # fmt: skip
    return [str(record.prompt) for record in records]


def self_instruct_records(
    target: Llama,
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    categories: Sequence[str] | None = None,
    seed: int = 0,
    temperature: float = 0.8,
    max_new_tokens: int = 48,
    batch_size: int = 64,
    exclude: Sequence[str] = (),
) -> list[PromptRecord]:
    """self_instruct_prompts as PromptRecords; with `categories` (names of
    CATEGORY_INSTRUCTIONS), topic j asks for a prompt of categories[j % len(categories)]
    and the record carries that category."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if categories is not None and (not categories or set(categories) - set(CATEGORY_INSTRUCTIONS)):
        raise ValueError(
            f"categories must be some of {tuple(CATEGORY_INSTRUCTIONS)}, got {tuple(categories)}"
        )
    topics = vocabulary_topics(tokenizer, exclude=heldout_words() | frozenset(exclude))
    if num_prompts and not topics:
        raise ValueError("the tokenizer has no whole-word tokens to use as topics")
    rng = random.Random(seed)
    rng.shuffle(topics)
    records: dict[str, PromptRecord] = {}
    # A third more requests than prompts wanted: some lines come back unusable.
    step = max(1, num_prompts + num_prompts // 3)
    for start in range(0, len(topics), step):
        if len(records) >= num_prompts:
            break
        chunk = topics[start : start + step]
        kinds = [_category(categories, start + j) for j in range(len(chunk))]
        asks = [_instruction(k, rng).format(topic=t) for k, t in zip(kinds, chunk, strict=True)]
        encoded = encode_prompts(asks, tokenizer)
        replies = generate_sequences(
            target,
            encoded,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed + start,
            batch_size=batch_size,
            eos_token_ids=tokenizer.eos_token_ids,
            desc="writing self-instruct prompts",
        )
        for kind, reply in zip(kinds, replies, strict=True):
            text = tokenizer.decode(reply.token_ids[reply.num_prompt :], skip_special_tokens=True)
            prompt = clean_prompt(text)
            if prompt is not None and prompt not in records:
                records[prompt] = PromptRecord(prompt, kind)
        logger.info("self-instruct: %d/%d prompts", min(len(records), num_prompts), num_prompts)
    return list(records.values())[:num_prompts]


def _category(categories: Sequence[str] | None, index: int) -> str | None:
    return None if categories is None else categories[index % len(categories)]


def _instruction(category: str | None, rng: random.Random) -> str:
    """The category's instruction, or (no category) one of INSTRUCTIONS drawn from `rng`."""
    return rng.choice(INSTRUCTIONS) if category is None else CATEGORY_INSTRUCTIONS[category]
