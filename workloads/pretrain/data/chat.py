"""Fine-tuning examples as (token ids, loss mask): chat ``messages`` or ``prompt``/``completion``.

A chat example is rendered by the tokenizer's own chat template (Jinja, as transformers renders
it: sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``), and the loss covers the
assistant turns only. Which characters are an assistant turn is found by rendering prefixes:
turn i spans from ``render(messages[:i], add_generation_prompt=True)`` to
``render(messages[:i + 1])`` (so the template's end-of-turn token is learned, its role header is
not). That works for any template whose renderings of a conversation's prefixes are prefixes of
its rendering, and whose generation prompt is how it starts an assistant turn in history, which
is what ``add_generation_prompt`` promises. A template that breaks either (DeepSeek-R1 distills
prompt with a ``<think>`` line that their history drops) would shift the mask into the answer,
so it is refused (``TemplateError``, a config error) naming its file and where the renderings
part. A token is a target when it holds a character of such a span.

``prompt``/``completion``: the prompt is encoded with the tokenizer's special tokens (BOS), the
completion without, then the end-of-text token; the loss covers the completion and that token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from workloads.protocol.records import RecordError, check_example, check_preference
from workloads.protocol.validate import ConfigError


class ExampleError(RecordError):
    """A fine-tuning record the user can fix; the message names the file and line. Its shape is
    checked by ``protocol.records.check_example`` (a ``RecordError``, as llmctl's preflight raises it)."""


class TemplateError(ConfigError):
    """A chat template whose assistant turns cannot be located: every chat would be masked wrong,
    so it is data.tokenizer to fix, not a record (the trainer reports it as a config error)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template and the special tokens it refers to; ``origin`` names the file it
    came from, for messages."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = "the chat template"

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _compiled(self.source).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str):
    if source not in _TEMPLATES:
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' assistant markers): the body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body, lineno=lineno)

        def raise_exception(message):
            raise ExampleError(f"the chat template refused this conversation: {message}")

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def load_chat_template(tokenizer_dir: Optional[str]) -> Optional[ChatTemplate]:
    """The chat template of a Hugging Face tokenizer directory (``chat_template.jinja`` or
    ``tokenizer_config.json``'s ``chat_template``), with its BOS/EOS strings; None if it has none."""
    if not tokenizer_dir or str(tokenizer_dir).endswith(".json"):
        return None
    import fsspec

    base = str(tokenizer_dir).rstrip("/")
    try:
        with fsspec.open(f"{base}/tokenizer_config.json", "r", encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        config = {}
    source = config.get("chat_template")
    origin = f"{base}/tokenizer_config.json's chat_template"
    if isinstance(source, list):  # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    try:
        with fsspec.open(f"{base}/chat_template.jinja", "r", encoding="utf-8") as f:
            source, origin = f.read(), f"{base}/chat_template.jinja"
    except FileNotFoundError:
        pass
    if not source:
        return None
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    return ChatTemplate(source, bos, eos, origin)


def _token_text(tok: Any) -> str:
    return (tok.get("content") if isinstance(tok, dict) else tok) or ""


def assistant_spans(
    template: ChatTemplate, messages: list[dict], where: str = "a conversation"
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [start, end) character spans of the assistant turns).

    Turn i must render, in the conversation up to it, as its generation prompt followed by the
    answer, and that rendering must begin the whole conversation's; otherwise the span's start is
    not where the answer starts and the mask would silently cover the wrong characters."""
    text = template.render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True) if i else ""
        upto = template.render(messages[: i + 1])
        for part, part_name, whole, whole_name in (
            (prompt, "the generation prompt", upto, f"message {i} as history"),
            (upto, f"the conversation up to message {i}", text, "the whole conversation"),
        ):
            if not whole.startswith(part):
                raise TemplateError(
                    f"data.tokenizer: {template.origin} renders {part_name} differently from {whole_name} "
                    f"({where}): {_parting(part, part_name, whole, whole_name)}; the loss mask would cover "
                    "the wrong characters. Use a tokenizer whose chat template renders each turn the same "
                    "wherever it stands and prompts an answer the way it starts one (data.tokenizer=<Hugging "
                    "Face tokenizer directory>), or give these examples as prompt/completion records"
                )
        spans.append((len(prompt), len(upto)))
    return text, spans


def _parting(part: str, part_name: str, whole: str, whole_name: str, width: int = 16) -> str:
    """Where two renderings part: the characters they share just before, then each one's next."""
    at = next((k for k, (a, b) in enumerate(zip(part, whole)) if a != b), min(len(part), len(whole)))
    return (
        f"after {part[max(0, at - width) : at]!r}, {part_name} has {part[at : at + width]!r} "
        f"but {whole_name} has {whole[at : at + width]!r}"
    )


def encode_example(
    record: Any, tokenizer: Any, eos_id: int, template: Optional[ChatTemplate], where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask): mask[i] is 1 where token i is a training target."""
    try:  # the record's shape: the protocol's one definition, as llmctl's preflight checks it
        kind = check_example(record, where)
    except RecordError as e:
        raise ExampleError(str(e)) from None
    if kind == "messages":
        return encode_chat(record["messages"], tokenizer, template, where)
    return encode_completion(str(record["prompt"]), str(record["completion"]), tokenizer, eos_id)


def encode_completion(prompt: str, completion: str, tokenizer: Any, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a prompt (with the tokenizer's special tokens: BOS) and its completion (without,
    then the end-of-text token); the mask covers the completion and that token."""
    head = tokenizer.encode(prompt, add_special_tokens=True).ids
    tail = tokenizer.encode(completion, add_special_tokens=False).ids + [eos_id]
    ids = np.asarray(head + tail, dtype=np.int64)
    return ids, np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])


def encode_chat(
    messages: list[dict], tokenizer: Any, template: Optional[ChatTemplate], where: str, first_answer: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a conversation rendered by ``template``; the mask covers the assistant turns
    from message ``first_answer`` on (a preference pair's answer, not its prompt's earlier turns)."""
    if template is None:
        raise ExampleError(
            f"{where}: chat 'messages' need a tokenizer with a chat template: set data.tokenizer="
            "<Hugging Face tokenizer directory whose tokenizer_config.json has chat_template> "
            "(model.init_from's checkpoint usually has one), or use prompt/completion records"
        )
    try:
        text, spans = assistant_spans(template, messages, where)
    except ExampleError as e:
        raise ExampleError(f"{where}: {e}") from None
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    spans = [span for i, span in zip(answers, spans) if i >= first_answer]
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:  # every token holding a character of the turn (as transformers marks them)
        mask[(offsets[:, 0] < b) & (offsets[:, 1] > a)] = 1
    return ids, mask


def encode_pair(
    record: Any, tokenizer: Any, eos_id: int, template: Optional[ChatTemplate], where: str
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int]:
    """A preference record as (chosen (ids, mask), rejected (ids, mask), prompt tokens): each answer
    after the same prompt, the mask on the answer only (TRL's completion mask)."""
    try:
        kind = check_preference(record, where)
    except RecordError as e:
        raise ExampleError(str(e)) from None
    if kind == "text":
        chosen = encode_completion(record["prompt"], record["chosen"], tokenizer, eos_id)
        rejected = encode_completion(record["prompt"], record["rejected"], tokenizer, eos_id)
    else:
        prompt = record["prompt"]
        chosen = encode_chat(prompt + record["chosen"], tokenizer, template, where, len(prompt))
        rejected = encode_chat(prompt + record["rejected"], tokenizer, template, where, len(prompt))
    prompt_tokens = min(int(np.argmax(m > 0)) if m.any() else len(m) for _, m in (chosen, rejected))
    return chosen, rejected, prompt_tokens
