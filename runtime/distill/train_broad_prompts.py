"""The categorised training prompts ("train-broad"): the eight categories of broad_prompts.py,
from templates and topics of their own, expanded to thousands of distinct prompts.

Expansion, all deterministic (fixed seeds; the split's `seed` only shuffles the result):
- topics with slots ({a}, {name}, {date}, ...: math word problems, reasoning puzzles, the
  made-up passages of extraction) are filled NUM_FILLINGS times with drawn numbers, names,
  places and dates; topics without slots are used once;
- every template x topic is asked as written, with a request for a short answer and with a
  request for a long one (LENGTH_FORMS), so answers of both lengths are in the data;
- one prompt in FOLLOW_UP_EVERY carries a follow-up turn of its category ("Now make it
  shorter.", "Explain step 2 in more detail.", ...): a flag the data generation expands into
  a second turn over the target's first answer (data.generate_record_sequences).
"""

from __future__ import annotations

import random
import string

from .broad_prompts import CategoryTable, PromptRecord, compose
from .train_broad_data import FILLERS, FOLLOW_UPS, LENGTH_FORMS, TRAIN_BROAD

NUM_FILLINGS = 3
FOLLOW_UP_EVERY = 4
_FILLING_SEED = 1234
_MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip


def slots(text: str) -> set[str]:
    """The names of the format slots in `text` ({a} -> "a")."""
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


def _values(rng: random.Random) -> dict[str, str]:
    """One draw of every slot a topic may use; dates in one passage run forwards."""
    names = rng.sample(FILLERS["names"], 3)
    start = rng.randint(1985, 2015)
    return {
        "a": str(rng.randint(12, 96)),
        "b": str(rng.randint(2, 9)),
        "c": str(rng.randint(3, 15)),
        "name": names[0],
        "name2": names[1],
        "name3": names[2],
        "place": rng.choice(FILLERS["places"]),
        "weekday": rng.choice(FILLERS["weekdays"]),
        "year": str(start - rng.randint(1, 30)),
        "date": f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {start}",
        "date2": f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {start + rng.randint(1, 8)}",
    }


def filled_topics(topics: tuple[str, ...], rng: random.Random) -> tuple[str, ...]:
    """Each topic once if it has no slots, else NUM_FILLINGS distinct fillings of it."""
    filled: list[str] = []
    for topic in topics:
        if not slots(topic):
            filled.append(topic)
            continue
        fillings: dict[str, None] = {}
        for _ in range(10 * NUM_FILLINGS):
            if len(fillings) == NUM_FILLINGS:
                break
            fillings[topic.format(**_values(rng))] = None
        filled.extend(fillings)
    return tuple(filled)


def expanded_table() -> dict[str, CategoryTable]:
    """TRAIN_BROAD with every topic filled (the same draws on every call)."""
    rng = random.Random(_FILLING_SEED)
    return {
        category: CategoryTable(entry.templates, filled_topics(entry.topics, rng))
        for category, entry in TRAIN_BROAD.items()
    }


def _with_lengths(record: PromptRecord, rng: random.Random) -> list[PromptRecord]:
    """The record as written, asking for a short answer, and asking for a long one."""
    forms = [rng.choice(LENGTH_FORMS["short"]), rng.choice(LENGTH_FORMS["long"])]
    return [record] + [PromptRecord(f"{record.prompt} {form}", record.category) for form in forms]


def train_broad_records(*, seed: int = 0) -> list[PromptRecord]:
    """The "train-broad" prompts: distinct texts, each with its category; one in
    FOLLOW_UP_EVERY with a follow-up turn. Shuffled by `seed` (the set does not depend on it)."""
    rng = random.Random(_FILLING_SEED + 1)
    records = [form for r in compose(expanded_table()) for form in _with_lengths(r, rng)]
    unique = list({r.prompt: r for r in records}.values())
    with_follow_ups = [
        PromptRecord(r.prompt, r.category, rng.choice(FOLLOW_UPS[r.category]))
        if i % FOLLOW_UP_EVERY == 0
        else r
        for i, r in enumerate(unique)
    ]
    random.Random(seed).shuffle(with_follow_ups)
    return with_follow_ups
