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
    file, or a directory / fsspec URL that holds one (and usually tokenizer_config.json)."""
    import fsspec
    from tokenizers import Tokenizer

    spec = str(spec).rstrip("/")
    is_file = spec.endswith(".json")
    path = spec if is_file else f"{spec}/tokenizer.json"
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"data.tokenizer={spec}: no tokenizer.json there (a Hugging Face tokenizer.json, or a"
                         " model directory holding one)") from None
    tok = Tokenizer.from_str(text)
    eos = None if is_file else _configured_eos(spec)
    if eos is None:
        eos = next((t for t in KNOWN_EOS if tok.token_to_id(t) is not None), None)
    if eos is None or tok.token_to_id(eos) is None:
        raise ValueError(f"data.tokenizer={spec}: cannot tell its end-of-text token (tokenizer_config.json has"
                         f" no eos_token, and none of {', '.join(KNOWN_EOS)} is in its vocabulary)")
    return tok, eos, text


def _configured_eos(spec: str) -> Optional[str]:
    import fsspec

    try:
        with fsspec.open(f"{spec}/tokenizer_config.json", "r", encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except FileNotFoundError:
        return None
    return eos.get("content") if isinstance(eos, dict) else eos
