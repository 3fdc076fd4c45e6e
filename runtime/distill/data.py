"""Training data for draft heads: prompts, self-distilled responses, batches, draft vocabulary.

Self-distillation: the head learns to predict what the target itself says, so the training
sequences are prompts followed by the target's own responses (greedy or sampled), decoded by
the runtime's own plain decoder: compiled and replayed as a CUDA graph on a GPU, eager on the
CPU. Only token ids are stored; the target's hidden states, taps and
logits are recomputed inside the training loop (see trainer.py), never dumped to disk.

A prompts file is JSON lines, each {"prompt": "text"} (chat-templated when the tokenizer has a
template) or {"prompt_ids": [ids...]} (used as is).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...models.llama import Llama
from ...models.tokenizer import Tokenizer
from ..config import EngineConfig, SamplingParams
from ..decoder import Decoder
from ..prefill import state_capacity
from .prompts import builtin_prompts

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
    built-in split named "builtin:train" / "builtin:heldout" (see prompts.py)."""
    if str(path).startswith(BUILTIN_PREFIX):
        return list(builtin_prompts(str(path)[len(BUILTIN_PREFIX) :]))
    prompts: list[Prompt] = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt_ids" in record:
                prompts.append([int(t) for t in record["prompt_ids"]])
            elif isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            else:
                raise ValueError(
                    f"{path}:{number}: expected {{'prompt': text}} or {{'prompt_ids': [ids]}}"
                )
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


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
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 16,
    eos_token_ids: Sequence[int] = (),
) -> list[TrainingSequence]:
    """The target's own responses to `prompts`, joined to their prompts.

    Decoded plainly `batch_size` prompts at a time by one Decoder with that single bucket
    (the last, smaller chunk is padded), so a GPU compiles and captures one graph. Prompt i
    samples with seed `seed + i`, whatever the batch size.
    """
    longest = max((len(p) for p in prompts), default=1)
    capacity = state_capacity(longest, max_new_tokens, depth=0)
    config = EngineConfig(buckets=(batch_size,), max_seq_len=capacity)
    decoder = Decoder(target, None, config, eos_token_ids=eos_token_ids)
    sequences = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            params = [
                SamplingParams(
                    temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + start + i
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
            logger.info("generated responses for %d/%d prompts", len(sequences), len(prompts))
    finally:
        decoder.close()
    return sequences


def save_sequences(sequences: Sequence[TrainingSequence], path: str | Path) -> None:
    """Write sequences as JSON lines {"token_ids": [...], "num_prompt": n}."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("w", encoding="utf-8") as f:
        for seq in sequences:
            f.write(json.dumps({"token_ids": list(seq.token_ids), "num_prompt": seq.num_prompt}))
            f.write("\n")


def load_sequences(path: str | Path) -> list[TrainingSequence]:
    """Read what `save_sequences` wrote, gzipped or not (by the `.gz` suffix)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no sequences file at {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [TrainingSequence(tuple(r["token_ids"]), int(r["num_prompt"])) for r in records]


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
    sequences: Sequence[TrainingSequence], *, batch_size: int, max_length: int, seed: int
) -> Batch:
    """A random batch, a pure function of `seed` (so a resumed run sees the same batches)."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(sequences), (batch_size,), generator=generator).tolist()
    return make_batch([sequences[i] for i in picks], max_length=max_length)


def iter_batches(
    sequences: Sequence[TrainingSequence], *, batch_size: int, max_length: int
) -> Iterator[Batch]:
    """All of `sequences` in order, `batch_size` at a time (evaluation)."""
    for start in range(0, len(sequences), batch_size):
        yield make_batch(sequences[start : start + batch_size], max_length=max_length)
