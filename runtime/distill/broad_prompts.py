"""Categorised prompts: the PromptRecord type, the eight categories, the "broad" held-out split.

"broad" measures acceptance on chat unlike the built-in training prompts: eight categories
(writing, roleplay, reasoning, math, coding, extraction, stem, humanities), each composed
from its own task templates (questions, instructions with constraints, word problems with
numbers, small coding specs, role-play setups, short made-up passages to extract facts from)
and topics, all written for this project. No template or topic is shared with the "train"
and "heldout" splits, with the categorised training source (train_broad_prompts.py) or with
self-instruct (whose topic words exclude every word used here: prompts.heldout_words).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: text (or token ids), its category (None when unknown), and an optional
    follow-up user turn, asked after the target's answer to the prompt (training data only;
    data.generate_record_sequences expands it into a two-turn conversation)."""

    prompt: str | tuple[int, ...]
    category: str | None = None
    follow_up: str | None = None


@dataclass(frozen=True)
class CategoryTable:
    """A category's task templates (each with one "{s}") and the topics filled into them."""

    templates: tuple[str, ...]
    topics: tuple[str, ...]


BROAD = {
    "writing": CategoryTable(
        templates=(
            "Write a short story of no more than 150 words about {s}.",
            "Compose an eight-line poem about {s} that does not rhyme.",
            "Write the opening paragraph of a magazine feature about {s}.",
            "Write a letter to the editor of a local paper about {s}, polite but firm in tone.",
        ),
        topics=(
            "a town where the bakery never closes",
            "an elderly neighbour who repairs radios for free",
            "the first snowfall seen by a child from the tropics",
            "a lost umbrella that changes owners five times",
            "a night bus driver's last shift before retirement",
            "a mural painted over a crumbling wall",
        ),
    ),
    "roleplay": CategoryTable(
        templates=(
            "Pretend you are {s}. Greet me and describe what your day usually looks like.",
            "Stay in character as {s} and answer: what do newcomers always get wrong?",
            "You are {s}. I am a nervous newcomer on my first day; advise me in character.",
            "Role-play as {s} who has just heard surprising news, and tell me about it.",
        ),
        topics=(
            "a ferry captain on a small island route",
            "a medieval blacksmith in a busy market town",
            "a zookeeper who looks after the reptile house",
            "a retired detective who now runs a bookshop",
            "the head chef of a crowded noodle restaurant",
            "a park ranger in a mountain forest",
        ),
    ),
    "reasoning": CategoryTable(
        templates=(
            "{s} Explain your reasoning step by step.",
            "Here is a puzzle. {s} Give the answer first, then justify it.",
            "{s} Is there exactly one answer? Show why or why not.",
            "Solve this logic problem and point out the key insight: {s}",
        ),
        topics=(
            "Four friends sit in a row. Lena sits at the left end, Mia is not at either end, "
            "Omar sits directly to the right of Mia, and Priya is not next to Lena. "
            "Where does Priya sit?",
            "A clock gains 3 minutes every hour. It is set correctly at noon. What time does "
            "it show when the real time is 8 p.m. the same day?",
            "Every glorp is a trink, and some trinks are blue. Must some glorps be blue?",
            "A drawer holds 6 red socks and 4 green socks. Without looking, how many socks "
            "must you take out to be sure of a matching pair?",
            "A two-digit house number has digits that add up to 9, and reversing its digits "
            "gives a number 27 larger. What is the house number?",
            "A train leaves at 9:40 and the trip takes 2 hours 35 minutes, but clocks at the "
            "destination are one hour behind. What local time does it arrive?",
        ),
    ),
    "math": CategoryTable(
        templates=(
            "{s} Show each step of the calculation.",
            "Give only the final answer, no working: {s}",
            "{s} After solving it, explain how you would check that the answer is right.",
            "Solve this word problem and state any assumption you make: {s}",
        ),
        topics=(
            "A cyclist rides 42 km at 14 km/h and then 18 km at 9 km/h. How long does the "
            "whole ride take?",
            "A recipe for 4 people uses 300 g of flour. How much flour is needed for 10 people?",
            "A jacket costs $80 and is discounted by 25%, then a 10% tax is added to the sale "
            "price. What is the final price?",
            "A rectangular pool is 12 m long, 5 m wide and 1.5 m deep. How many litres of "
            "water does it hold when full?",
            "Sara saves $35 a week and already has $120. How many weeks until she can afford "
            "a $500 bicycle?",
            "Three workers paint a fence in 6 hours. How long would 4 workers take at the "
            "same rate?",
        ),
    ),
    "coding": CategoryTable(
        templates=(
            "Write a Python function for {s}. Include a docstring and type hints.",
            "Implement {s} in JavaScript and state the time complexity.",
            "Show a short Python solution for {s}, then list three edge cases to test.",
            "Explain how you would approach {s} before writing any code, then write it in C.",
        ),
        topics=(
            "checking whether a string reads the same backwards, ignoring spaces and case",
            "merging two sorted lists of integers into one sorted list without calling sort",
            "counting the words of a paragraph and returning the three most common",
            "converting a number of seconds into a string like '2h 05m 09s'",
            "finding the first missing positive integer in an unsorted list",
            "validating that every opening bracket in a string has a matching closing one",
        ),
    ),
    "extraction": CategoryTable(
        templates=(
            "List every date mentioned in the passage below, with what happened on it.\n\n{s}",
            "From the following text, extract each person's name and role as a JSON list.\n\n{s}",
            "Read this passage and write down every number in it, saying what each one "
            "measures.\n\n{s}",
            "Summarize the passage below in one sentence, then name the places it mentions.\n\n{s}",
        ),
        topics=(
            "The Harlow Valley Choir was founded on 3 March 1987 by music teacher Elsie Marr "
            "in the village of Denby Cross. It began with 14 singers and gave its first "
            "concert that June. By its 25th anniversary the choir had 62 members, and "
            "conductor Paul Idris led a tour to Ghent in May 2012.",
            "On 11 September 2019 the town council of Port Avelin approved a new footbridge "
            "over the Lune estuary. Engineer Ravi Chandra estimated the cost at 2.4 million "
            "euros. Work started on 6 January 2020, and mayor Ingrid Holm opened the "
            "180-metre crossing on 30 October 2021.",
            "Marine biologist Amaka Obi began counting seals on Gull Rock in April 2015, when "
            "she recorded 210 animals. Her assistant, Tomas Veld, repeated the survey every "
            "August. The count fell to 160 in 2018 but recovered to 245 by 14 August 2023, "
            "the highest figure since records began in 1974.",
            "The Kestrel Street reading room reopened on 2 February 2024 after an eight-month "
            "refit led by architect Nadia Ferro. It now holds 48,000 books and 30 public "
            "computers. Head librarian Owen Pryce said visits in the first week reached "
            "3,100, against about 1,200 a week before it closed on 1 June 2023.",
            "In July 1998, brothers Karim and Yusuf Haddad opened a spice shop on Mill Lane in "
            "the port of Saltmere. Karim made the buying trips to Zanzibar while Yusuf kept "
            "the accounts. The shop took a second unit in 2006, employed 11 staff by 2015, "
            "and was sold to their cousin Leila on 19 November 2022.",
            "The Ridgeway Hill Race was first run on 12 May 1962 with 23 entrants. Course "
            "designer Margaret Stoll set the route at 9.5 kilometres with a climb of 410 "
            "metres. The record of 38 minutes 12 seconds was set by Jonas Eberle on 14 May "
            "2016 in Brackley, where the race now starts.",
        ),
    ),
    "stem": CategoryTable(
        templates=(
            "Explain {s} to a first-year engineering student, using one equation if it helps.",
            "In two or three sentences, what is {s}?",
            "Give a concrete worked example that illustrates {s}.",
            "Describe an experiment or a measurement that demonstrates {s}.",
        ),
        topics=(
            "the Doppler effect",
            "how a transistor acts as a switch",
            "why a spinning top stays upright",
            "how a heat pump moves warmth from a cold place to a warm one",
            "the role of enzymes in digestion",
            "how a satellite navigation receiver works out its position",
        ),
    ),
    "humanities": CategoryTable(
        templates=(
            "Explain {s} and why scholars still debate it.",
            "Write three discussion questions about {s} for a university seminar.",
            "What should a newcomer understand first about {s}? Answer in one paragraph.",
            "Give two contrasting perspectives on {s}, each stated fairly.",
        ),
        topics=(
            "the causes of the Thirty Years' War",
            "the idea of the social contract",
            "how rent controls affect housing supply",
            "the Meiji Restoration in Japan",
            "why languages borrow words from each other",
            "the influence of the Bauhaus school on modern design",
        ),
    ),
}


def compose(table: Mapping[str, CategoryTable]) -> list[PromptRecord]:
    """Every template x topic of every category, in table order."""
    return [
        PromptRecord(template.format(s=topic), category)
        for category, entry in table.items()
        for template in entry.templates
        for topic in entry.topics
    ]


def broad_records(*, seed: int = 0) -> list[PromptRecord]:
    """The "broad" held-out split (8 categories x 4 templates x 6 topics), shuffled by `seed`."""
    records = compose(BROAD)
    random.Random(seed).shuffle(records)
    return records
