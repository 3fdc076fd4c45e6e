"""Rebuild a Hugging Face tokenizer.json from the vocabulary stored in a GGUF file's metadata.

A GGUF carries the tokenizer as data, not as a `tokenizers` pipeline: the tokens (in id order),
their types, the BPE merges (byte-level vocabularies) or scores (sentencepiece vocabularies),
the special-token ids and a `tokenizer.ggml.pre` name for the pre-tokenizer llama.cpp applies.
We map that name to the equivalent `tokenizers` pre-tokenizer; a name we do not know is refused
rather than guessed, because a wrong split silently changes every token id.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

if TYPE_CHECKING:
    from .gguf import GGUFMetadata

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)

_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
}

# Pre-tokenizer families, by llama.cpp's `tokenizer.ggml.pre` names.
GPT2_PRE = ("gpt-2",)
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")
SUPPORTED_PRE = GPT2_PRE + DIGIT_SPLIT_PRE + LLAMA3_PRE
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPM_SPACE = "\u2581"


def special_token_ids(meta: GGUFMetadata) -> dict[str, int]:
    """{"bos", "eos", "unk", "pad", "eot", "eom"} -> id, for those the file names."""
    num_tokens = len(meta.require("tokenizer.ggml.tokens"))
    ids = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        value = meta.get(key)
        if value is None:
            continue
        if not 0 <= int(value) < num_tokens:
            raise ValueError(f"{key}={value} is outside the vocabulary (size {num_tokens})")
        ids[name] = int(value)
    return ids


def build_tokenizer(meta: GGUFMetadata) -> tuple[Tokenizer, dict[str, Any]]:
    """The `tokenizers` pipeline and the tokenizer_config.json dict a GGUF file describes."""
    kind = meta.require("tokenizer.ggml.model")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if kind == "gpt2":
        tokenizer, add_bos = _byte_level_tokenizer(meta, tokens)
    elif kind == "llama":
        tokenizer, add_bos = _sentencepiece_tokenizer(meta, tokens, types)
    else:
        raise ValueError(
            f"tokenizer.ggml.model={kind!r} is not supported; specrun rebuilds 'gpt2' (byte-level "
            "BPE) and 'llama' (sentencepiece BPE) vocabularies"
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind_ in zip(tokens, types, strict=True)
            if kind_ in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind_ in zip(tokens, types, strict=True)
            if kind_ == TOKEN_USER_DEFINED
        ]
    )
    special = special_token_ids(meta)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    processor = _post_processor(tokens, special, add_bos=add_bos, add_eos=add_eos)
    if processor is not None:
        tokenizer.post_processor = processor
    config = _tokenizer_config(meta, tokens, special, add_bos=add_bos, add_eos=add_eos)
    return tokenizer, config


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if len(vocab) != len(tokens):
        logger.warning(
            "%d duplicate token strings; the first id of each is used", len(tokens) - len(vocab)
        )
    return vocab


def _byte_level_tokenizer(meta: GGUFMetadata, tokens: list[str]) -> tuple[Tokenizer, bool]:
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        logger.warning("no tokenizer.ggml.pre in %s; assuming GPT-2 splitting", meta.path.name)
        pre = "gpt-2"
    if pre not in SUPPORTED_PRE:
        raise ValueError(
            f"tokenizer.ggml.pre={pre!r} is not supported; specrun knows {SUPPORTED_PRE}"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    bpe = models.BPE(_unique_vocab(tokens), merges, ignore_merges=pre in LLAMA3_PRE)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in LLAMA3_PRE)
    if pre in DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer, pre in LLAMA3_PRE


def _sentencepiece_tokenizer(
    meta: GGUFMetadata, tokens: list[str], types: list[int]
) -> tuple[Tokenizer, bool]:
    """Sentencepiece BPE (Llama 2, Mistral): merges ranked by the merged token's score."""
    scores = list(meta.require("tokenizer.ggml.scores"))
    vocab = _unique_vocab(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab,
        sentencepiece_merges(tokens, scores, types, vocab),
        unk_token=None if unk_id is None else tokens[int(unk_id)],
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    space = normalizers.Replace(" ", SPM_SPACE)
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), space])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.normalizer = space
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, True


def sentencepiece_merges(
    tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary tokens, best-scored result first."""
    ranked = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind != TOKEN_NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _post_processor(
    tokens: list[str], special: dict[str, int], *, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing | None:
    """Adds BOS/EOS on `encode(..., add_special_tokens=True)` as the file asks."""
    used = {}
    if add_bos and "bos" in special:
        used["bos"] = (tokens[special["bos"]], special["bos"])
    if add_eos and "eos" in special:
        used["eos"] = (tokens[special["eos"]], special["eos"])
    if not used:
        return None
    prefix = [used["bos"][0]] if "bos" in used else []
    suffix = [used["eos"][0]] if "eos" in used else []
    single = [*prefix, "$A:0", *suffix]
    pair = [*single, *prefix, "$B:1", *suffix]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(set(used.values()))
    )


def _tokenizer_config(
    meta: GGUFMetadata,
    tokens: list[str],
    special: dict[str, int],
    *,
    add_bos: bool,
    add_eos: bool,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name in ("bos", "eos", "unk", "pad"):
        config[f"{name}_token"] = tokens[special[name]] if name in special else None
    context = meta.get(f"{meta.architecture}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return config
