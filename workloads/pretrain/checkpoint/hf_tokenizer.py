"""The tokenizer half of a Hugging Face export: its files, the real BOS and EOS, the chat template.

What the export says about special tokens must be what the run's tokenizer did, so it comes from
where that tokenizer came from:

* A Hugging Face directory (``data.tokenizer``, which ``model.init_from`` sets to the checkpoint's
  own): its ``tokenizer_config.json`` (BOS, EOS, chat template, tokenizer class),
  ``special_tokens_map.json`` and ``chat_template.jinja`` are handed on as they are; the ids in its
  ``config.json`` go into the export's, and its ``generation_config.json`` is handed on whole, as
  long as they name the tokenizer's EOS (else they belong to another vocabulary: ``stops_at``). A
  Llama 3 export thus starts text with ``<|begin_of_text|>``, ends it with ``<|end_of_text|>`` and,
  for an Instruct model, still stops generating at ``<|eot_id|>``, as the source does.
* llmctl's own BPE, a bare ``tokenizer.json`` or a tiktoken file: the EOS is the run's end-of-text
  token; the BOS is the special token the tokenizer's post-processor puts before text (a tiktoken
  file's ``<|begin_of_text|>``), else there is none. None is written as absent (transformers then
  has ``bos_token`` None) and as ``"bos_token_id": null`` in config.json, since a config without
  the key gets ``LlamaConfig``'s default id 1, some arbitrary token of this vocabulary.

JSON, fsspec and ``tokenizers`` only: transformers is not needed to write an export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# copied from the source directory as they are, when it has them
HANDED_ON = ("special_tokens_map.json", "chat_template.jinja")
# transformers 5 saves every tokenizers-backed tokenizer under this class name, which 4.x does not
# know; 4.x and 5.x both load PreTrainedTokenizerFast as that same backend
TF5_ONLY_CLASS, PORTABLE_CLASS = "TokenizersBackend", "PreTrainedTokenizerFast"


@dataclass(frozen=True)
class TokenizerExport:
    files: dict[str, str] = field(default_factory=dict)  # file name -> text, into the export
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    # for config.json: bos_token_id / eos_token_id (an id, a list of ids, or None), pad_token_id if known
    token_ids: dict[str, Any] = field(default_factory=lambda: {"bos_token_id": None, "eos_token_id": None})
    generation_config: dict[str, Any] = field(default_factory=dict)


def source_dir(spec: Optional[str]) -> Optional[str]:
    """``data.tokenizer`` when it names a Hugging Face directory (local or URL); None for a bare
    ``tokenizer.json``, a tiktoken file, or no pretrained tokenizer."""
    if not spec:
        return None
    spec = str(spec).rstrip("/")
    return None if spec.endswith((".json", ".tiktoken", "tokenizer.model")) else spec


def tokenizer_export(
    tokenizer_file: str | Path, eos_token: Optional[str], max_seq_len: int, source: Optional[str] = None
) -> TokenizerExport:
    """The tokenizer files and special-token ids of an export; ``source``: the Hugging Face
    directory the run's tokenizer came from (``source_dir``), if any."""
    text = Path(tokenizer_file).read_text(encoding="utf-8")
    files = {"tokenizer.json": text}
    source = source.rstrip("/") if source else None
    config_text = _read(f"{source}/tokenizer_config.json") if source else None
    if config_text is not None:
        config = json.loads(config_text)
        if config.get("tokenizer_class") == TF5_ONLY_CLASS:
            config["tokenizer_class"] = PORTABLE_CLASS
            config_text = json.dumps(config, indent=2, ensure_ascii=False)
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token")) or eos_token
        files["tokenizer_config.json"] = config_text
        for name in HANDED_ON:
            handed = _read(f"{source}/{name}")
            if handed is not None:
                files[name] = handed
    else:
        bos, eos = leading_special(text), eos_token
        special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
        config = {
            "tokenizer_class": PORTABLE_CLASS,
            **special,
            "model_max_length": int(max_seq_len),
            "clean_up_tokenization_spaces": False,
        }
        files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False)
        files["special_tokens_map.json"] = json.dumps(special, indent=2, ensure_ascii=False)
    if not eos:
        raise ValueError(f"{tokenizer_file}: no end-of-text token given or configured")
    vocab = _token_ids(text)
    ids = {"bos_token_id": _id(vocab, bos, tokenizer_file), "eos_token_id": _id(vocab, eos, tokenizer_file)}
    eos_id = ids["eos_token_id"]
    model_config = read_json(f"{source}/config.json") if source else None
    if model_config and stops_at(model_config, eos_id):
        # the source's own (a list where an Instruct model stops at several tokens)
        ids = {k: model_config.get(k) for k in ("bos_token_id", "eos_token_id")}
        if model_config.get("pad_token_id") is not None:
            ids["pad_token_id"] = model_config["pad_token_id"]
    generation = read_json(f"{source}/generation_config.json") if source else None
    if not (generation and stops_at(generation, eos_id)):
        generation = {k: v for k, v in ids.items() if v is not None}
    return TokenizerExport(files, bos, eos, ids, generation)


def stops_at(config: dict[str, Any], eos_id: int) -> bool:
    """Whether a source's config.json / generation_config.json names the tokenizer's EOS among its
    own; one that does not (a config saved with LlamaConfig's default ids 1 and 2 beside some other
    tokenizer) describes another vocabulary, and the tokenizer's ids are written instead."""
    named = config.get("eos_token_id")
    return eos_id in (named if isinstance(named, list) else [named])


def leading_special(tokenizer_text: str) -> Optional[str]:
    """The special token the tokenizer's post-processor puts before any text (its BOS), if any."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_text)
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if plain and full[:1] != plain[:1] and full[1 : 1 + len(plain)] == plain:
        return tok.id_to_token(full[0])
    return None


def _token_ids(tokenizer_text: str) -> dict[str, int]:
    spec = json.loads(tokenizer_text)
    vocab = dict(spec.get("model", {}).get("vocab", {}) or {})
    if isinstance(spec.get("model", {}).get("vocab"), list):  # unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(spec["model"]["vocab"])}
    vocab.update({t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])})
    return vocab


def _id(vocab: dict[str, int], token: Optional[str], where: str | Path) -> Optional[int]:
    if token is None:
        return None
    if token not in vocab:
        raise ValueError(f"{where} has no token {token!r}")
    return vocab[token]


def _token_text(tok: Any) -> Optional[str]:
    """``"<s>"`` or transformers' ``{"content": "<s>", ...}``; None for null or empty."""
    return (tok.get("content") if isinstance(tok, dict) else tok) or None


def _read(url: str) -> Optional[str]:
    import fsspec

    try:
        with fsspec.open(url, "r", encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def read_json(url: str) -> Optional[dict[str, Any]]:
    text = _read(url)
    return json.loads(text) if text is not None else None
