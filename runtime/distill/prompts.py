"""Built-in chat prompts for self-distillation and acceptance evaluation, made here.

Prompts are composed from task templates and subjects, so no data set is downloaded and no
public benchmark prompt is used. Four splits:
- "train" and "heldout" (here) share no subject and no template: acceptance measured on
  "heldout" is on prompts unlike any the head was trained on, though in the same style;
- "broad" (broad_prompts.py): a held-out set of eight categories of chat (writing, roleplay,
  reasoning, math, coding, extraction, stem, humanities), in forms and on topics that no
  training source uses;
- "train-broad" (train_broad_prompts.py): training prompts over the same eight categories,
  thousands of them, some with a follow-up turn.
Composition is deterministic (a seeded shuffle), so a split is the same list everywhere.
`builtin_prompt_records` gives each prompt with its category (None for "train" and
"heldout"); `builtin_prompts` the texts only.
"""

from __future__ import annotations

import random

from .broad_prompts import BROAD, PromptRecord, broad_records
from .train_broad_prompts import train_broad_records

SPLITS = ("train", "heldout", "broad", "train-broad")

_TRAIN_TEMPLATES = (
    "Explain {s} to a curious ten-year-old.",
    "Write a short poem about {s}.",
    "Give me three interesting facts about {s}.",
    "What are the pros and cons of {s}?",
    "Summarize the history of {s} in a paragraph.",
    "Write a friendly email inviting a colleague to learn about {s}.",
    "How would you teach a beginner about {s}? Give a step-by-step plan.",
    "Describe {s} in exactly five sentences.",
    "What questions should I ask an expert on {s}?",
    "Write a short story in which {s} plays a key role.",
    "List common misconceptions about {s} and correct them.",
    "Give a one-paragraph overview of {s} for a newsletter.",
    "Write a dialogue between a student and a teacher about {s}.",
    "What is the most important idea behind {s}?",
    "Create a short quiz with answers about {s}.",
    "Explain {s} using an analogy.",
    "Write a limerick about {s}.",
    "What careers involve {s}?",
    "Give practical tips related to {s}.",
    "How has {s} changed over the last hundred years?",
)
_HELDOUT_TEMPLATES = (
    "Tell me something surprising about {s}.",
    "Write a haiku about {s}.",
    "Why do people care about {s}? Answer briefly.",
    "Draft a tweet about {s}.",
    "Compare {s} with something from everyday life.",
    "What would a good introduction to {s} cover?",
)
_TRAIN_SUBJECTS = (
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "black holes",
    "the human heart",
    "honeybees",
    "the printing press",
    "electric cars",
    "recycling",
    "the Roman Empire",
    "machine learning",
    "compound interest",
    "sleep",
    "the moon landing",
    "coral reefs",
    "chess",
    "jazz music",
    "bread baking",
    "rainforests",
    "the internet",
    "vaccines",
    "earthquakes",
    "solar panels",
    "the Olympic Games",
    "origami",
    "climate change",
    "the stock market",
    "dinosaurs",
    "public libraries",
    "bicycles",
    "coffee",
    "glaciers",
    "the immune system",
    "hash tables",
    "democracy",
    "the Great Wall of China",
    "tea",
    "migration of birds",
    "renewable energy",
    "the periodic table",
    "mountain climbing",
    "meditation",
    "the Renaissance",
    "video games",
    "the ocean tides",
    "wind turbines",
    "penguins",
    "sourdough starters",
    "the violin",
    "time zones",
    "blood types",
    "the French Revolution",
    "quantum computing",
    "ancient Egypt",
    "the Amazon river",
    "wolves",
    "robots",
    "the theory of evolution",
    "mathematics",
    "prime numbers",
    "soccer",
    "the piano",
    "street food",
    "architecture",
    "Mars",
    "tornadoes",
    "cloud computing",
    "password security",
    "spreadsheets",
    "the Python language",
    "databases",
    "operating systems",
    "batteries",
    "nuclear power",
    "airplanes",
    "trains",
    "the postal service",
    "newspapers",
    "photography",
    "cinema",
    "theatre",
    "poetry",
    "the Silk Road",
    "the Vikings",
    "samurai",
    "pyramids",
    "castles",
    "pirates",
    "elephants",
    "whales",
    "ants",
    "mushrooms",
    "cacti",
    "oak trees",
    "tulips",
    "chocolate",
    "cheese making",
    "rice farming",
    "vegetarian cooking",
    "spices",
    "running",
    "swimming",
    "yoga",
    "basketball",
    "tennis",
    "marathons",
    "gymnastics",
    "friendship",
    "kindness",
    "procrastination",
    "habits",
    "public speaking",
    "budgeting",
    "job interviews",
    "remote work",
    "teamwork",
    "negotiation",
    "the metric system",
    "calendars",
    "clocks",
    "maps",
    "compasses",
    "magnets",
    "electricity",
    "sound waves",
    "light",
    "gravity",
    "rainbows",
    "clouds",
    "deserts",
    "islands",
    "caves",
    "waterfalls",
    "the Arctic",
    "Antarctica",
)
_HELDOUT_SUBJECTS = (
    "eagles",
    "lighthouses",
    "the Sahara desert",
    "submarines",
    "paper money",
    "owls",
    "snowflakes",
    "the telescope",
    "gardening",
    "rivers",
    "bridges",
    "octopuses",
    "the alphabet",
    "hot air balloons",
    "volunteering",
    "museums",
)


def builtin_prompt_records(
    split: str, *, num_prompts: int | None = None, seed: int = 0
) -> list[PromptRecord]:
    """The split's prompts with their categories, shuffled by `seed`, first num_prompts."""
    if split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; use one of {SPLITS}")
    if num_prompts is not None and num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if split == "broad":
        records = broad_records(seed=seed)
    elif split == "train-broad":
        records = train_broad_records(seed=seed)
    else:
        records = [PromptRecord(text) for text in _template_split(split, seed=seed)]
    return records[:num_prompts] if num_prompts is not None else records


def builtin_prompts(split: str, *, num_prompts: int | None = None, seed: int = 0) -> list[str]:
    """The split's prompt texts, shuffled by `seed`, first num_prompts."""
    records = builtin_prompt_records(split, num_prompts=num_prompts, seed=seed)
    return [str(record.prompt) for record in records]


def _template_split(split: str, *, seed: int) -> list[str]:
    """ "train" or "heldout": every template x subject, shuffled by `seed`."""
    templates, subjects = (
        (_TRAIN_TEMPLATES, _TRAIN_SUBJECTS)
        if split == "train"
        else (_HELDOUT_TEMPLATES, _HELDOUT_SUBJECTS)
    )
    prompts = [t.format(s=s) for t in templates for s in subjects]
    random.Random(seed).shuffle(prompts)
    return prompts


def heldout_words() -> frozenset[str]:
    """Every lower-case word of the held-out splits' templates and topics ("heldout" and
    "broad"), so prompt sources built elsewhere (self_instruct.py) stay clear of them."""
    broad = [text for entry in BROAD.values() for text in (*entry.templates, *entry.topics)]
    text = " ".join((*_HELDOUT_TEMPLATES, *_HELDOUT_SUBJECTS, *broad)).lower()
    return frozenset("".join(c if c.isalpha() else " " for c in text).split())
