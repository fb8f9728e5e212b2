"""A CPU-sized chat checkpoint made offline, for trying fine-tuning without downloading a model.

Writes a Hugging Face directory as a real chat model has one: a random Llama (``config.json``,
safetensors, ``generation_config.json``) and a tokenizer with a BOS it puts before text, an
end-of-turn EOS and a Llama-3-style chat template (with transformers' ``{% generation %}`` markers
around what the assistant says). The tokenizer is a byte-level BPE trained on Python's own manual
(``pydoc_data``, shipped with CPython), and ``--chats FILE`` writes conversations about it as
``{"messages": [...]}`` lines for ``data=sft``. Used by docs/finetune.md:

    python3 examples/tiny_chat_checkpoint.py tiny-chat --chats chats.jsonl
    python3 examples/tiny_chat_checkpoint.py tiny-chat-256 --hidden-size 256   # QLoRA's NF4 groups

Needs transformers (the ``hf`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def manual() -> dict[str, str]:
    """Python's manual, topic by topic (what ``help('assert')`` shows)."""
    from pydoc_data.topics import topics

    return {k: topics[k] for k in sorted(topics)}


def tokenizer(vocab_size: int):  # -> transformers.PreTrainedTokenizerFast
    """A byte-level BPE with the special tokens of a Llama 3 chat model, BOS added before text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(manual().values()), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    out.chat_template = TEMPLATE
    return out


def chats() -> list[dict]:
    """One short conversation per paragraph of the manual: a question about a topic, the paragraph."""
    out = []
    for topic, text in manual().items():
        for para in text.split("\n\n"):
            if 80 < len(para) < 400:
                question = {"role": "user", "content": f"What does the manual say about {topic}?"}
                out.append({"messages": [question, {"role": "assistant", "content": para.strip()}]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the checkpoint directory to write")
    p.add_argument("--hidden-size", type=int, default=64, help="the model's width (QLoRA needs 256: NF4 groups)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--chats", type=Path, help="also write the manual's conversations here (JSON lines)")
    args = p.parse_args()

    import torch
    import transformers

    tok = tokenizer(args.vocab_size)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(args.out))
    tok.save_pretrained(str(args.out))
    print(f"wrote {args.out}: Llama {args.hidden_size} wide, {args.layers} layers, tokenizer with a chat template")
    if args.chats:
        rows = chats()
        args.chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {args.chats}: {len(rows)} conversations")


if __name__ == "__main__":
    main()
