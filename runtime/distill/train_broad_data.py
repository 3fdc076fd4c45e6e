"""The text train_broad_prompts.py expands: per category, task templates (one "{s}" each) and
topics (some with slots such as {a} or {name}, filled there), follow-up turns, the short and
long answer requests, and the names, places and weekdays that fill the slots.

All written for this project; nothing here appears in the "train", "heldout" or "broad"
splits (tests/distill/test_broad_prompts.py checks it).
"""

from __future__ import annotations

from .broad_prompts import CategoryTable

TRAIN_BROAD = {
    "writing": CategoryTable(
        templates=(
            "Write a free-verse poem about {s}.",
            "Write a short scene, mostly dialogue, about {s}.",
            "Write the back-cover blurb for a novel about {s}.",
            "Write a diary entry by someone who witnessed {s}.",
            "Write a fable with a clear moral, inspired by {s}.",
            "Write a humorous paragraph about {s}.",
            "Write song lyrics with a chorus about {s}.",
            "Write a suspenseful first paragraph for a story about {s}.",
        ),
        topics=(
            "a cat that learns to ride the subway",
            "the last day of summer camp",
            "a grandmother's handwritten recipe book",
            "a machine that collects seashells",
            "a rainy wedding in a small village",
            "a forgotten key found in an old coat",
            "two rival food trucks on the same street",
            "a city during a power outage",
            "a painter who can only use the colour blue",
            "a long train journey across a frozen country",
            "a dog waiting at the school gate",
            "a market where people trade memories",
            "a street musician's broken guitar",
            "a kite stuck in a tall tree",
            "moving to a new country alone",
            "a school play where everything goes wrong",
            "an astronaut's first morning back on Earth",
            "a village that wakes up with no shadows",
            "a letter delivered fifty years late",
            "the smell of rain on a hot pavement",
            "an old fisherman and a talking seagull",
            "a notebook that finishes your sentences",
            "a friendship between a giant and a mouse",
            "the quiet hour before a big storm",
        ),
    ),
    "roleplay": CategoryTable(
        templates=(
            "Act as {s}. I will ask you questions; start by introducing yourself.",
            "You are {s}. Describe your workplace to me as I walk in.",
            "Play the role of {s} and tell me a story from your career.",
            "Imagine you are {s}. A customer is unhappy with your work. Respond in character.",
            "Take on the persona of {s} and give me three tips for my first week in your job.",
            "As {s}, tell me what a typical morning looks like.",
            "Pretend to be {s} on a local radio show. First question: how did you get started?",
            "You are {s}. Tell me about the strangest request you have ever had.",
        ),
        topics=(
            "a train conductor on a night express",
            "a pirate captain looking for a new crew",
            "a barista in a busy city café",
            "a wizard who runs a repair shop",
            "a tour guide in ancient Rome",
            "a hotel concierge in a grand old hotel",
            "an engineer on a space station",
            "a veterinarian in a farming town",
            "a flight attendant on a long-haul flight",
            "a fashion designer the night before a show",
            "a guide who leads hikers up a volcano",
            "a lifeguard at a crowded beach",
            "a tailor in the 1920s",
            "a taxi driver who knows every shortcut",
            "a private investigator in a foggy 1940s city",
            "a contestant on a televised cooking competition",
            "the librarian of a school for magic",
            "a fitness coach who is always cheerful",
            "a support agent for a phone company",
            "a history teacher at a high school",
            "the host of a quiz show",
            "a florist preparing wedding bouquets",
            "an innkeeper in a fantasy kingdom",
            "a scientist at a remote research base",
        ),
    ),
    "reasoning": CategoryTable(
        templates=(
            "{s}",
            "Think carefully and answer: {s}",
            "{s} Walk me through how you reached the answer.",
            "Can you solve this? {s}",
            "My friend gave me this riddle and I am stuck: {s}",
            "{s} Also explain a wrong answer people often give.",
            "Reason about the following and state your conclusion clearly: {s}",
            "{s} Check your answer before you reply.",
        ),
        topics=(
            "{name} is taller than {name2}, and {name2} is taller than {name3}. "
            "Who is the shortest?",
            "If today is {weekday}, what day of the week will it be in {a} days?",
            "A snail climbs {b} metres up a wall each day and slides back 1 metre each night. "
            "The wall is {a} metres high. On which day does it reach the top?",
            "A bag holds {a} red and {b} blue marbles. How many must you draw without looking "
            "to be sure of two of the same colour?",
            "{name2} has {b} books. {name} has {a} more than twice as many as {name2}. How "
            "many books do they have together?",
            "In a race, {name} finished ahead of {name2} but behind {name3}. Who came second?",
            "If {c} machines make {c} parts in {b} minutes, how long do {a} machines take to "
            "make {a} parts?",
            "{name} walks {a} metres north, {b} metres east, then {a} metres south. How far "
            "is {name} from the starting point?",
            "If the day before yesterday was {weekday}, what day is the day after tomorrow?",
            "There are {a} people at a meeting and each shakes hands with every other person "
            "once. How many handshakes are there?",
            "What comes next in the sequence 2, 6, 12, 20, 30, and why?",
            "Every member of a club that owns a boat also owns a life jacket. Sam owns a life "
            "jacket. Does Sam own a boat?",
            "A man says: 'Everything I say is false.' Can that statement be true?",
            "If some doctors are runners and all runners are early risers, must some doctors "
            "be early risers?",
        ),
    ),
    "math": CategoryTable(
        templates=(
            "{s}",
            "Solve step by step: {s}",
            "{s} Give the final answer on its own line at the end.",
            "Work out the answer and show your method: {s}",
            "{s} Explain the reasoning behind each step.",
            "I need help with my homework. {s}",
            "{s} Just give me the number.",
            "Set up an equation for this problem and solve it: {s}",
        ),
        topics=(
            "A shop sells pencils at {b}5 cents each. How much do {a} pencils cost in dollars?",
            "A car uses {b} litres of fuel per 100 km. How much fuel does a {c}0 km trip need?",
            "{name} reads {a} pages a day. How many days does a book of {c}00 pages take?",
            "A garden is {a} m long and {b} m wide. What are its area and its perimeter?",
            "A class has {a} students and {b} of them are absent. What percentage is present?",
            "A train runs at {a} km/h for {b} hours, then at {c}0 km/h for 2 hours. How far "
            "does it go in total?",
            "{name} buys {b} notebooks at ${c} each and pays with a $200 bill. How much "
            "change is there?",
            "A coat costs ${a}. It is reduced by {b}0 percent. What is the new price?",
            "A tank holds {c}00 litres and drains at {b} litres per minute. How long until "
            "it is empty?",
            "The average of {b} test scores is {a}. One more test scores 100. What is the "
            "new average?",
        ),
    ),
    "coding": CategoryTable(
        templates=(
            "Write Python code for {s}.",
            "How do I go about {s} in Python? Show an example.",
            "Write a TypeScript function for {s}, with a short usage example.",
            "Give me a Go implementation of {s}.",
            "Write a Python solution for {s}, with unit tests.",
            "I'm learning to code. Explain, with code, an approach to {s}.",
            "Write a Rust function for {s} and explain how it handles bad input.",
            "I want to write a function for {s}. What pitfalls should I watch for, and what "
            "would the code look like?",
        ),
        topics=(
            "reversing the order of words in a sentence",
            "removing duplicates from a list while keeping the original order",
            "computing the moving average of a list of numbers with a given window",
            "parsing a CSV line that may contain quoted commas",
            "checking whether two strings are anagrams",
            "finding the longest common prefix of a list of strings",
            "flattening a nested list of any depth",
            "rotating a square matrix by 90 degrees",
            "generating all subsets of a small set",
            "computing the greatest common divisor of two numbers",
            "grouping a list of dictionaries by one of their keys",
            "counting the lines, words and characters of a text file",
            "a simple stack with push, pop and peek",
            "finding two numbers in a list that add up to a target",
            "converting a Roman numeral to an integer",
            "formatting a list of names as 'A, B and C'",
            "checking whether a year is a leap year",
            "retrying a network call with exponential backoff",
            "caching the results of an expensive function",
            "splitting a list into chunks of a given size",
        ),
    ),
    "extraction": CategoryTable(
        templates=(
            "Extract all the dates from this text and put them in chronological order.\n\n{s}",
            "Who are the people mentioned below, and what does each of them do?\n\n{s}",
            "Pull out every number in this passage and say what it refers to, as a table.\n\n{s}",
            "Read the text and answer: where does it take place, and when?\n\n{s}",
            "Turn the key facts of this passage into a JSON object.\n\n{s}",
            "Give a one-line headline and three bullet-point facts for this passage.\n\n{s}",
            "{s}\n\nBased only on the text above, what happened first and what happened last?",
            "{s}\n\nList the organisations and places named in the text above.",
        ),
        topics=(
            "{name} opened a small bicycle workshop in {place} on {date}. In its first year "
            "the workshop repaired {a}0 bikes. Its apprentice, {name2}, took over the business "
            "on {date2} and added a shop selling {b} kinds of helmet.",
            "The {place} Book Festival ran from {date} to {date2}. Organiser {name} said "
            "{c}00 visitors came, and novelist {name2} gave the opening talk to {a} people.",
            "On {date}, {name}, head of the {place} water board, announced a new reservoir "
            "holding {c} million litres. Engineer {name2} expects building it to take {b} years.",
            "Photographer {name} spent {b} weeks in {place} in {year}, taking {a}0 pictures of "
            "the harbour. An exhibition of {c} of them opened on {date}, curated by {name2}.",
            "{place} Rovers, an amateur football team, was founded on {date} by {name}. They "
            "won their first league title after {b} seasons, and on {date2} their captain, "
            "{name2}, scored {c} goals in one match.",
            "The {place} community kitchen served {a}0 meals in {year}. Volunteer coordinator "
            "{name} recruited {c} new helpers after an appeal on {date}, and chef {name2} "
            "added a vegetarian menu of {b} dishes.",
            "Inventor {name} filed a patent for a folding ladder on {date}. The first {a} were "
            "built in a workshop in {place}, and by {date2} business partner {name2} had sold "
            "{c}00 of them.",
            "A storm hit {place} on {date}, bringing {a} millimetres of rain in {b} hours. "
            "Weather officer {name} said it was the wettest day since {year}, and the mayor, "
            "{name2}, opened {c} emergency shelters.",
        ),
    ),
    "stem": CategoryTable(
        templates=(
            "How does {s} work?",
            "Explain the science behind {s} in plain language.",
            "What are the key principles or equations behind {s}?",
            "Write a short study guide on {s} with three review questions.",
            "Why does {s} matter in engineering or everyday technology?",
            "Describe {s} and give one real-world example.",
            "What experiments or observations first revealed {s}?",
            "Explain {s} first in one sentence, then in more depth.",
        ),
        topics=(
            "the greenhouse effect",
            "Ohm's law",
            "natural selection",
            "the Bernoulli principle",
            "an induction cooktop",
            "a flywheel energy store",
            "the pH scale",
            "DNA replication",
            "the Fourier transform",
            "a hydraulic press",
            "plate tectonics",
            "cellular respiration",
            "the speed of sound",
            "antibiotic resistance",
            "a jet engine",
            "error-correcting codes",
            "radioactive half-life",
            "a microwave oven",
            "friction",
            "public-key encryption",
        ),
    ),
    "humanities": CategoryTable(
        templates=(
            "Give an overview of {s}.",
            "Why is {s} important for understanding the modern world?",
            "What do critics and supporters say about {s}?",
            "Explain {s} with a historical or everyday example.",
            "Write a short essay introduction on {s}.",
            "What are three key terms someone studying {s} should know? Define each.",
            "How did thinking about {s} change over time?",
            "Summarize {s} for a student preparing for an exam.",
        ),
        topics=(
            "the Industrial Revolution",
            "the Cold War",
            "utilitarianism",
            "inflation and interest rates",
            "central banking",
            "the abolition of slavery in the nineteenth century",
            "the Enlightenment",
            "urbanization",
            "the fall of the Berlin Wall",
            "stoicism",
            "the separation of powers",
            "the Harlem Renaissance",
            "game theory",
            "the Protestant Reformation",
            "behavioural economics",
            "the Mongol Empire",
            "existentialism",
            "the welfare state",
            "social mobility",
            "propaganda in wartime",
        ),
    ),
}

FOLLOW_UPS = {
    "writing": (
        "Now make it shorter.",
        "Rewrite it in a more formal tone.",
        "Give it a different ending.",
        "Now tell it from another character's point of view.",
    ),
    "roleplay": (
        "Stay in character and tell me more.",
        "What would you do if I ignored your advice?",
        "Now describe the same morning on a really bad day.",
        "Step out of character: what made that persona convincing?",
    ),
    "reasoning": (
        "Explain step 2 in more detail.",
        "What if one of the conditions were different?",
        "Can you check that answer another way?",
        "Explain it again as simply as possible.",
    ),
    "math": (
        "Explain step 2 in more detail.",
        "Now solve it again with every number doubled.",
        "How could I estimate the answer in my head?",
        "Write me a similar practice problem with its answer.",
    ),
    "coding": (
        "Now add error handling.",
        "Write two tests for it.",
        "Can it be made faster? If not, why not?",
        "Rewrite it without using any library functions.",
    ),
    "extraction": (
        "Now put that in a table.",
        "Which of those facts matters most, and why?",
        "Give me the same information as JSON.",
        "Now make it shorter.",
    ),
    "stem": (
        "Can you give an analogy for that?",
        "Explain the second point in more detail.",
        "What would a typical exam question on this look like?",
        "Now explain it to a ten-year-old.",
    ),
    "humanities": (
        "What is the strongest counterargument?",
        "Now make it shorter.",
        "Name two primary sources I could read.",
        "How does this connect to today?",
    ),
}

LENGTH_FORMS = {
    "short": ("Keep it short.", "Answer in under 60 words.", "Be brief."),
    "long": (
        "Give a detailed, thorough answer.",
        "Take your time and be thorough.",
        "Answer at length, with examples.",
    ),
}

FILLERS = {
    "names": (
        "Ines Kowal", "Bram Okafor", "Talia Reyes", "Jonah Lindqvist", "Mira Castell",
        "Felix Adeyemi", "Rosa Marchetti", "Dev Anand", "Greta Holloway", "Samir Qureshi",
        "Lucia Fontaine", "Arlo Brennan", "Hana Sato", "Viktor Ilić", "Chloe Ampofo",
        "Oskar Nyberg",
    ),
    "places": (
        "Ashwick", "Little Brenning", "Carrow Bay", "Eastholm", "Marlow Fen", "Tarnside",
        "Kilbrook", "Westmere", "Orchard Cross", "Hallam Ridge", "Penford", "Sully Point",
    ),
    "weekdays": (
        "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
    ),
}  # fmt: skip
