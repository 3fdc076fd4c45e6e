"""Training data for draft heads: prompts, self-distilled responses, batches, draft vocabulary.

Self-distillation: the head learns to predict what the target itself says, so the training
sequences are prompts followed by the target's own responses (greedy or sampled), decoded by
the runtime's own plain decoder: compiled and replayed as a CUDA graph on a GPU, eager on the
CPU. Only token ids are stored; the target's hidden states, taps and
logits are recomputed inside the training loop (see trainer.py), never dumped to disk.

A prompts file is JSON lines, each {"prompt": "text"} (chat-templated when the tokenizer has a
template) or {"prompt_ids": [ids...]} (used as is), optionally with "category": "name" (kept
for per-category evaluation) and, with "prompt", "follow_up": "text": a second user turn.

Follow-ups are answered in a second pass: the target first answers every prompt; a prompt
with a follow-up then becomes the conversation [user prompt, assistant first answer, user
follow-up], chat-templated, and the target answers that too. Both answers are training
sequences (the second's prompt holds the whole first turn). Without a chat template
follow-ups are skipped.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ...models.llama import Llama
from ...models.tokenizer import Tokenizer
from ..config import EngineConfig, SamplingParams
from ..decoder import Decoder
from ..prefill import state_capacity
from .prompts import PromptRecord, builtin_prompt_records

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(frozen=True)
class TrainingSequence:
    """One prompt + the target's response: `token_ids` holds both, the first `num_prompt`
    ids are the prompt (not trained on as predictions)."""

    token_ids: tuple[int, ...]
    num_prompt: int


@dataclass
class Batch:
    """Right-padded sequences.

    tokens: [B, T] int64 (padding 0); lengths: [B] int64 valid tokens per row;
    loss_mask: [B, T] bool, True where a token is a response token worth predicting.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tokens.to(device), self.lengths.to(device), self.loss_mask.to(device))


BUILTIN_PREFIX = "builtin:"


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts of a JSONL file ({"prompt": str} or {"prompt_ids": [int]} per line), or a
    built-in split named "builtin:NAME" (see prompts.py); categories and follow-ups dropped."""
    return [_as_prompt(record.prompt) for record in read_prompt_records(path)]


def read_prompt_records(path: str | Path) -> list[PromptRecord]:
    """Prompts with their categories and follow-ups, from a JSONL file or "builtin:NAME"."""
    if str(path).startswith(BUILTIN_PREFIX):
        return builtin_prompt_records(str(path)[len(BUILTIN_PREFIX) :])
    records: list[PromptRecord] = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                records.append(_prompt_record(json.loads(line), f"{path}:{number}"))
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def _prompt_record(record: dict, where: str) -> PromptRecord:
    """One JSONL line as a PromptRecord; `where` names the file and line in errors."""
    if "prompt_ids" in record:
        prompt: str | tuple[int, ...] = tuple(int(t) for t in record["prompt_ids"])
    elif isinstance(record.get("prompt"), str):
        prompt = record["prompt"]
    else:
        raise ValueError(f"{where}: expected {{'prompt': text}} or {{'prompt_ids': [ids]}}")
    category, follow_up = record.get("category"), record.get("follow_up")
    if category is not None and not (isinstance(category, str) and category):
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    if follow_up is not None and not (isinstance(follow_up, str) and isinstance(prompt, str)):
        raise ValueError(f"{where}: 'follow_up' must be text, and needs a text 'prompt'")
    return PromptRecord(prompt, category, follow_up)


def _as_prompt(prompt: str | tuple[int, ...]) -> Prompt:
    return prompt if isinstance(prompt, str) else list(prompt)


def encode_prompts(
    prompts: Sequence[Prompt], tokenizer: Tokenizer | None, *, chat_template: bool = True
) -> list[list[int]]:
    """Token ids of each prompt: text is chat-templated as a user turn when the tokenizer has
    a template (and `chat_template`), else encoded raw; id lists pass through."""
    encoded = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            encoded.append(list(prompt))
            continue
        if tokenizer is None:
            raise ValueError("text prompts need the model's tokenizer.json")
        if chat_template and tokenizer.has_chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            encoded.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            encoded.append(tokenizer.encode(prompt, add_special_tokens=True))
    return encoded


def generate_sequences(
    target: Llama,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float | Sequence[float] = 0.0,
    seed: int = 0,
    batch_size: int = 16,
    eos_token_ids: Sequence[int] = (),
    desc: str = "answering prompts",
    on_chunk: Callable[[Sequence[TrainingSequence]], None] | None = None,
) -> list[TrainingSequence]:
    """The target's own responses to `prompts`, joined to their prompts.

    Decoded plainly `batch_size` prompts at a time by one Decoder with that single bucket
    (the last, smaller chunk is padded), so a GPU compiles and captures one graph. Prompt i
    samples at `temperature` (one for all, or one per prompt) with seed `seed + i`, whatever
    the batch size. A progress bar labelled `desc` counts the prompts answered, and
    `on_chunk`, if given, is called with each chunk's sequences once they are decoded.
    """
    temperatures = _per_prompt(temperature, len(prompts))
    longest = max((len(p) for p in prompts), default=1)
    capacity = state_capacity(longest, max_new_tokens, depth=0)
    config = EngineConfig(buckets=(batch_size,), max_seq_len=capacity)
    decoder = Decoder(target, None, config, eos_token_ids=eos_token_ids)
    sequences = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            params = [
                SamplingParams(
                    temperature=temperatures[start + i],
                    max_new_tokens=max_new_tokens,
                    seed=seed + start + i,
                )
                for i in range(len(chunk))
            ]
            responses: list[list[int]] = [[] for _ in chunk]
            with torch.inference_mode():
                for step in decoder.stream(chunk, params):
                    for response, (tokens, _reason) in zip(responses, step, strict=True):
                        response.extend(tokens)
            for prompt, response in zip(chunk, responses, strict=True):
                sequences.append(TrainingSequence((*prompt, *response), len(prompt)))
            bar.update(len(chunk))
            if on_chunk is not None:
                on_chunk(sequences[-len(chunk) :])
    finally:
        bar.close()
        decoder.close()
    return sequences


def _per_prompt(temperature: float | Sequence[float], num_prompts: int) -> list[float]:
    if isinstance(temperature, int | float):
        return [float(temperature)] * num_prompts
    if len(temperature) != num_prompts:
        raise ValueError(f"{len(temperature)} temperatures for {num_prompts} prompts")
    return [float(t) for t in temperature]


def response_temperatures(num_prompts: int, temperatures: Sequence[float]) -> list[float]:
    """Prompt i's response temperature: temperatures[i % len(temperatures)], so (0, 1)
    answers every other prompt greedily and the rest sampled, and (0, 0, 1) a third sampled."""
    if not temperatures or min(temperatures) < 0:
        raise ValueError(f"response temperatures must be >= 0 and given, got {temperatures}")
    return [float(temperatures[i % len(temperatures)]) for i in range(num_prompts)]


def generate_record_sequences(
    target: Llama,
    tokenizer: Tokenizer | None,
    records: Sequence[PromptRecord],
    *,
    max_new_tokens: int,
    temperatures: Sequence[float] = (0.0,),
    seed: int = 0,
    batch_size: int = 16,
    chat_template: bool = True,
) -> list[TrainingSequence]:
    """The target's answers to `records` (temperatures per response_temperatures), each
    followed by its follow-up turn's answer when it has one (see the module docstring).

    The follow-up pass samples prompt i's second answer at the same temperature as its first,
    with seed `seed + len(records) + j` (j counting follow-ups), so no seed repeats."""
    temps = response_temperatures(len(records), temperatures)
    eos = tokenizer.eos_token_ids if tokenizer is not None else target.config.eos_token_ids
    options = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "eos_token_ids": eos}
    encoded = encode_prompts([r.prompt for r in records], tokenizer, chat_template=chat_template)
    first = generate_sequences(target, encoded, temperature=temps, seed=seed, **options)
    asked = [i for i, r in enumerate(records) if r.follow_up is not None]
    templated = chat_template and tokenizer is not None and tokenizer.has_chat_template
    if asked and not templated:
        logger.warning("%d follow-ups skipped: they need a chat template", len(asked))
        asked = []
    if not asked:
        return first
    conversations = [_conversation(tokenizer, records[i], first[i]) for i in asked]
    second = generate_sequences(
        target, conversations, temperature=[temps[i] for i in asked],
        seed=seed + len(records), **options,
    )  # fmt: skip
    follow_ups = dict(zip(asked, second, strict=True))
    return [s for i, seq in enumerate(first) for s in (seq, follow_ups.get(i)) if s is not None]


def _conversation(tokenizer: Tokenizer, record: PromptRecord, answer: TrainingSequence):
    """Token ids of [user prompt, assistant answer, user follow-up], chat-templated."""
    text = tokenizer.decode(answer.token_ids[answer.num_prompt :], skip_special_tokens=True)
    messages = [
        {"role": "user", "content": record.prompt},
        {"role": "assistant", "content": text.strip()},
        {"role": "user", "content": record.follow_up},
    ]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def save_sequences(sequences: Sequence[TrainingSequence], path: str | Path) -> None:
    """Write sequences as JSON lines {"token_ids": [...], "num_prompt": n}, gzipped when the
    path ends in `.gz`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "wt") as f:
        for seq in sequences:
            f.write(json.dumps({"token_ids": list(seq.token_ids), "num_prompt": seq.num_prompt}))
            f.write("\n")


def load_sequences(path: str | Path) -> list[TrainingSequence]:
    """Read what `save_sequences` wrote, gzipped or not (by the `.gz` suffix)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no sequences file at {path}")
    with _open_text(path, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [TrainingSequence(tuple(r["token_ids"]), int(r["num_prompt"])) for r in records]


def load_sequence_files(paths: Sequence[str | Path]) -> list[TrainingSequence]:
    """The sequences of several `save_sequences` files, in the order given."""
    return [seq for path in paths for seq in load_sequences(path)]


def _open_text(path: Path, mode: str):
    """A UTF-8 text file, gzipped when its name ends in `.gz`."""
    opener = gzip.open if path.suffix == ".gz" else open
    return opener(path, mode, encoding="utf-8")


def token_frequencies(sequences: Sequence[TrainingSequence], *, vocab_size: int) -> torch.Tensor:
    """Counts [vocab_size] int64 of the response tokens (the ones a draft must propose)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        response = torch.tensor(seq.token_ids[seq.num_prompt :], dtype=torch.int64)
        counts += torch.bincount(response, minlength=vocab_size)
    return counts


def draft_vocab(frequencies: torch.Tensor, *, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent ids as an EAGLE-3 vocabulary map.

    Args:
        frequencies: [V] int64 token counts.
        size: draft vocabulary size (<= V); ties are broken towards the smaller id.
    Returns:
        d2t [size] int64 (target id = draft id + d2t[draft id], ids kept in increasing order)
        and t2d [V] bool (True for target ids in the draft vocabulary).
    """
    vocab = frequencies.shape[0]
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size {size} must be in (0, {vocab}]")
    # Stable sort on -count keeps equal counts in id order.
    order = torch.sort(-frequencies, stable=True).indices[:size]
    kept = order.sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(size), t2d


def make_batch(sequences: Sequence[TrainingSequence], *, max_length: int) -> Batch:
    """Right-pad `sequences` (each truncated to `max_length`) into one Batch."""
    rows = [seq.token_ids[:max_length] for seq in sequences]
    length = max(map(len, rows))
    tokens = torch.zeros(len(rows), length, dtype=torch.int64)
    loss_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, (row, seq) in enumerate(zip(rows, sequences, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        loss_mask[i, seq.num_prompt : len(row)] = True
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return Batch(tokens, lengths, loss_mask)


def sample_batch(
    sequences: Sequence[TrainingSequence],
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    step: int,
    length_groups: int = 1,
) -> Batch:
    """Step `step`'s batch, a pure function of (seed, step) so that a resumed run sees the
    same batches: `batch_size` random sequences.

    With `length_groups` G > 1, steps come in runs of G that share G * batch_size random
    sequences, sorted by length and cut into G batches of about equal response tokens, taken
    in a random order: each batch pads to about its own rows' length instead of the longest
    of a random draw, and holds about as many response tokens as a random batch (more rows
    of short answers, fewer of long ones), so every token weighs in the loss's per-batch
    mean as it does in random batches.
    """
    run, position = divmod(step, length_groups)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + run)
    picks = torch.randint(len(sequences), (length_groups * batch_size,), generator=generator)
    if length_groups > 1:
        groups = _equal_token_groups(sequences, picks, length_groups, max_length=max_length)
        picks = groups[int(torch.randperm(length_groups, generator=generator)[position])]
    return make_batch([sequences[i] for i in picks.tolist()], max_length=max_length)


def _equal_token_groups(
    sequences: Sequence[TrainingSequence],
    picks: torch.Tensor,
    num_groups: int,
    *,
    max_length: int,
) -> list[torch.Tensor]:
    """`picks` ([N] indices into `sequences`) sorted by truncated length and cut into
    `num_groups` non-empty runs of about equal response tokens."""
    chosen = [sequences[i] for i in picks.tolist()]
    lengths = torch.tensor([len(seq.token_ids) for seq in chosen]).clamp(max=max_length)
    responses = (lengths - torch.tensor([seq.num_prompt for seq in chosen])).clamp(min=0)
    order = torch.sort(lengths, stable=True).indices
    cumulative = torch.cumsum(responses[order], 0)
    quotas = cumulative[-1] * torch.arange(1, num_groups) // num_groups
    ends = torch.searchsorted(cumulative, quotas, right=True).tolist()
    # Each run at least one sequence, and room left for the runs after it.
    bounds = [0]
    for k, end in enumerate(ends, start=1):
        bounds.append(min(max(end, bounds[-1] + 1), len(order) - (num_groups - k)))
    bounds.append(len(order))
    return [picks[order[a:b]] for a, b in itertools.pairwise(bounds)]


def iter_batches(
    sequences: Sequence[TrainingSequence], *, batch_size: int, max_length: int
) -> Iterator[Batch]:
    """All of `sequences` in order, `batch_size` at a time (evaluation)."""
    for start in range(0, len(sequences), batch_size):
        yield make_batch(sequences[start : start + batch_size], max_length=max_length)
