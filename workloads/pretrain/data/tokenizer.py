"""The corpus's tokenizer: a byte-level BPE trained for it (lossless on any text), or a pretrained
one (``data.tokenizer``: a Hugging Face ``tokenizer.json``) with its own end-of-text token."""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

EOT = "<|endoftext|>"
# a bare tokenizer.json says nothing of its end-of-text token: these are the common ones
KNOWN_EOS = (EOT, "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer): lossless on any text, no unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def load_pretrained(spec: str) -> tuple[Any, str, str]:
    """(tokenizer, end-of-text token, tokenizer.json text) for ``data.tokenizer``: a tokenizer.json
    file, a directory / fsspec URL that holds one (and usually tokenizer_config.json), or a tiktoken
    BPE file (``*.tiktoken``, Meta's ``tokenizer.model``; ``tiktoken_file``)."""
    import fsspec
    from tokenizers import Tokenizer

    spec = str(spec).rstrip("/")
    if spec.endswith((".tiktoken", "tokenizer.model")):
        tok = tiktoken_file(spec)
        return tok, LLAMA3_EOS, tok.to_str()
    is_file = spec.endswith(".json")
    path = spec if is_file else f"{spec}/tokenizer.json"
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(
            f"data.tokenizer={spec}: no tokenizer.json there (a Hugging Face tokenizer.json, a"
            " model directory holding one, or a tiktoken BPE file: *.tiktoken / tokenizer.model)"
        ) from None
    tok = Tokenizer.from_str(text)
    eos = None if is_file else _configured_eos(spec)
    if eos is None:
        eos = next((t for t in KNOWN_EOS if tok.token_to_id(t) is not None), None)
    if eos is None or tok.token_to_id(eos) is None:
        raise ValueError(
            f"data.tokenizer={spec}: cannot tell its end-of-text token (tokenizer_config.json has"
            f" no eos_token, and none of {', '.join(KNOWN_EOS)} is in its vocabulary)"
        )
    return tok, eos, text


def _configured_eos(spec: str) -> Optional[str]:
    import fsspec

    try:
        with fsspec.open(f"{spec}/tokenizer_config.json", "r", encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except FileNotFoundError:
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


# Meta's Llama 3 tokenizer (llama_models/llama3/tokenizer.py): the pre-tokenizer pattern and the
# 256 special tokens that follow the BPE ranks. A tiktoken file holds only the ranks.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"
_LLAMA3_NAMED = [
    LLAMA3_BOS,
    LLAMA3_EOS,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL = _LLAMA3_NAMED + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_NAMED))]


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, as byte-level BPE vocabularies write tokens."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


_BYTE_CHARS = _gpt2_byte_chars()


def _byte_level(token: bytes) -> str:
    return "".join(_BYTE_CHARS[b] for b in token)


def tiktoken_file(spec: str):
    """A tiktoken BPE file (``base64-token rank`` per line) as a ``tokenizers`` byte-level BPE with
    Llama 3's pre-tokenizer pattern and special tokens (ids after the ranks), adding
    ``<|begin_of_text|>`` like Meta's and Hugging Face's Llama 3 tokenizers.

    The merges are recovered from the ranks as transformers' ``TikTokenConverter`` does: every
    split of a token into two tokens whose concatenation it is, in rank order; with
    ``ignore_merges`` a pre-token that is itself in the vocabulary maps straight to it, as in
    tiktoken. No tiktoken (or transformers) needed at run time.
    """
    import base64

    import fsspec
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ranks: dict[bytes, int] = {}
    try:
        with fsspec.open(spec, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
                    except ValueError:
                        raise ValueError(
                            f"data.tokenizer={spec}:{lineno}: not a tiktoken BPE file (each line: "
                            f"<base64 token> <rank>)"
                        ) from None
    except FileNotFoundError:
        raise ValueError(f"data.tokenizer={spec}: no such file") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"data.tokenizer={spec}: the ranks are not 0..{len(ranks) - 1} without gaps")
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(ranks[a], ranks[b], rank, a, b) for a, b in splits]
    merges.sort(key=lambda m: (m[2], m[0], m[1]))
    vocab = {_byte_level(t): r for t, r in ranks.items()}
    tok = Tokenizer(models.BPE(vocab, [(_byte_level(a), _byte_level(b)) for *_, a, b in merges], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A",
        pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B",
        special_tokens=[(LLAMA3_BOS, tok.token_to_id(LLAMA3_BOS))],
    )
    return tok
