"""Fine-tuning data (``data.format=sft``): chat ``messages`` and ``prompt``/``completion`` records.

Oracles nobody here wrote: transformers' ``apply_chat_template(return_assistant_tokens_mask=True)``
for which tokens are the assistant's; the model run on each example alone for what packing must
compute; the single-process run for what 2 ranks must compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import loss_env

VOCAB = 512
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's chat template, shortened, with transformers' {% generation %} markers around what the
# assistant says (the oracle for the loss mask); the generation prompt is the assistant's header.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "What is a tuple?"}, {"role": "assistant", "content": "An immutable sequence."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Define  a set"},
        {"role": "assistant", "content": " Unordered, unique items. "},
        {"role": "user", "content": "And a dict?"},
        {"role": "assistant", "content": "A mapping\nof keys to values."},
    ],
    [
        {"role": "user", "content": "Say nothing"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer directory with a chat template and a BOS-adding post-processor."""
    transformers = pytest.importorskip("transformers")
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [topics[k] for k in sorted(topics)],
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    hf.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(str(out))
    return out


def _ours(tokenizer_dir: Path, record: dict):
    from tokenizers import Tokenizer

    from workloads.pretrain.data.chat import encode_example, load_chat_template

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return encode_example(record, tok, tok.token_to_id("<|eot_id|>"), load_chat_template(str(tokenizer_dir)), "t:1")


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "system-two-turns", "ends-with-user"])
def test_loss_mask_is_the_chat_templates_assistant_spans(tokenizer_dir: Path, chat: list) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    want = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = _ours(tokenizer_dir, {"messages": chat})
    assert ids.tolist() == list(want["input_ids"])
    assert mask.tolist() == list(want["assistant_masks"])
    assert 0 < mask.sum() < len(mask)
    eot = hf.convert_tokens_to_ids("<|eot_id|>")
    answers = sum(m["role"] == "assistant" for m in chat)
    assert int(((ids == eot) & (mask == 1)).sum()) == answers  # each answer's end-of-turn is learned
    assert ids[0] == hf.bos_token_id and mask[0] == 0


def test_prompt_completion_learns_the_completion_and_its_end(tokenizer_dir: Path) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids, mask = _ours(tokenizer_dir, {"prompt": "Q: what is None?\nA:", "completion": " the null object"})
    prompt = hf("Q: what is None?\nA:")["input_ids"]  # with BOS, as the tokenizer adds it
    completion = hf(" the null object", add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    assert ids.tolist() == prompt + completion
    assert mask.tolist() == [0] * len(prompt) + [1] * len(completion)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "x"}, "needs 'messages' (a chat) or 'prompt' and 'completion'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"prompt": "hi"}, "needs a 'completion'"),
        ({"messages": "hi"}, "list of {role, content} objects"),
    ],
)
def test_bad_records_are_named(tokenizer_dir: Path, record: dict, message: str) -> None:
    from workloads.pretrain.data.chat import ExampleError

    with pytest.raises(ExampleError, match="^t:1: ") as info:
        _ours(tokenizer_dir, record)
    assert message in str(info.value)


def test_messages_without_a_chat_template_are_refused() -> None:
    from tokenizers import Tokenizer, models

    from workloads.pretrain.data.chat import ExampleError, encode_example

    with pytest.raises(ExampleError, match="need a tokenizer with a chat template: set data.tokenizer="):
        encode_example({"messages": CHATS[0]}, Tokenizer(models.BPE()), 0, None, "f.jsonl:3")


# Templates whose assistant turns cannot be found by rendering prefixes. DeepSeek-R1 distills: the
# generation prompt opens a "<think>\n" that history does not hold, so the span would start 8
# characters into the answer. Qwen3: a think block on the last turn only, so a turn renders one way
# as the conversation's last and another inside it.
R1_STYLE = TEMPLATE.replace("<|end_header_id|>\n\n{% endif %}", "<|end_header_id|>\n\n<think>\n{% endif %}")
LAST_TURN_THINKS = TEMPLATE.replace(
    "{% generation %}", "{% generation %}{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
)


@pytest.mark.parametrize(
    "template, parting",
    [
        (
            R1_STYLE,
            "the generation prompt differently from message 1 as history ({src}:1): after "
            "'nd_header_id|>\\n\\n', the generation prompt has '<think>\\n' but message 1 as history has "
            "'An immutable seq'",
        ),
        (
            LAST_TURN_THINKS,  # line 1 (one turn) renders alike; line 2's first answer does not
            "the conversation up to message 2 differently from the whole conversation ({src}:2): after "
            "'nd_header_id|>\\n\\n', the conversation up to message 2 has '<think>\\n\\n</think' but the "
            "whole conversation has 'Unordered, uniqu'",
        ),
    ],
    ids=["prompt-opens-think", "last-turn-thinks"],
)
def test_a_template_whose_turns_cannot_be_located_is_a_config_error(
    tokenizer_dir: Path, tmp_path: Path, template: str, parting: str
) -> None:
    """Refused while the data is prepared, nothing cached, as data.tokenizer's fault (a ConfigError:
    the trainer prints it as a config error and exits EXIT_CONFIG), naming the template's file, the
    characters where its renderings part, and the fix. The committed check let the first through,
    marking 'rld<|eot_id|>' of an answer 'hello world'."""
    import shutil

    from workloads.pretrain.data import prepare_corpus
    from workloads.protocol.schema import DataCfg
    from workloads.protocol.validate import ConfigError

    bad = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, bad)
    config = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (bad / "chat_template.jinja").unlink(missing_ok=True)  # transformers 5 saves the template there
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as info:
        prepare_corpus(DataCfg(format="sft", source=str(src), tokenizer=str(bad), cache_dir=str(cache)))
    message = str(info.value)
    assert message.startswith(
        f"data.tokenizer: {bad}/tokenizer_config.json's chat_template renders {parting.format(src=src)}; "
    ), message
    assert message.endswith(
        "(data.tokenizer=<Hugging Face tokenizer directory>), or give these examples as prompt/completion records"
    )
    assert not list(cache.glob("*/meta.json"))


@pytest.mark.parametrize("kernels", ["reference", "fused"])
def test_packed_examples_compute_what_each_example_computes_alone(make_tiny_cfg, kernels: str) -> None:
    """Per-example positions and block-causal attention: a packed row's logits and summed loss
    equal those of its examples run one at a time (fp32)."""
    from workloads.pretrain.data.sampler import IGNORE_INDEX, PackedExamples
    from workloads.pretrain.model.transformer import build_model

    cfg = make_tiny_cfg(**{"model.kernels": kernels, "model.vocab_size": VOCAB})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    rng = np.random.default_rng(0)
    lengths = [9, 30, 5, 17, 12, 40, 3]  # tokens per example; 40 > seq_len + 1: truncated
    tokens = rng.integers(0, VOCAB, sum(lengths)).astype(np.uint16)
    mask = (rng.random(sum(lengths)) < 0.6).astype(np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    packed = PackedExamples(tokens, mask, offsets, seq_len=32)
    # positions per example 8, 29, 4, 16, 11, 32 (39 truncated), 2: next-fit bins [8] [29] [4 16 11] [32] [2]
    assert packed.truncated == 1 and packed.bins.tolist() == [0, 1, 2, 5, 6, 7]
    batch = packed.batch(range(len(packed)), packed.targets_in(range(len(packed))), "cpu")
    with torch.no_grad():
        logits = model(batch.inputs, **batch.model_kwargs())
        packed_sum = model(batch.inputs, batch.targets, **batch.model_kwargs(), reduction="sum")
        alone_sum, n_targets = 0.0, 0
        for row in range(batch.inputs.shape[0]):
            for j in range(packed.bins[row], packed.bins[row + 1]):
                s, n = int(packed.starts[j]), int(packed.lengths[j])
                x = torch.from_numpy(tokens[s : s + n].astype(np.int64))[None]
                y = torch.from_numpy(
                    np.where(mask[s + 1 : s + 1 + n] > 0, tokens[s + 1 : s + 1 + n].astype(np.int64), IGNORE_INDEX)
                )
                at = (batch.doc_ids[row] == j - packed.bins[row]).nonzero().flatten()
                torch.testing.assert_close(logits[row, at], model(x)[0], atol=1e-5, rtol=1e-5)
                assert torch.equal(batch.targets[row, at], y.long())
                alone_sum += float(model(x, y.long()[None], reduction="sum"))
                n_targets += int((y != IGNORE_INDEX).sum())
    assert batch.global_targets == n_targets == int((batch.targets != IGNORE_INDEX).sum())
    assert abs(float(packed_sum) - alone_sum) < 1e-3, (float(packed_sum), alone_sum)


def test_examples_cut_to_seq_len_are_said_with_the_length_that_keeps_them() -> None:
    """Issue #34, item 10: docs/finetune.md's recipe cut 408 of its 1,312 examples at seq_len 64 and
    only a clause in the data line said so. A line of its own now says how many and what fits."""
    from workloads.pretrain.data.sampler import PackedExamples
    from workloads.pretrain.train import truncation_warning

    def packed(lengths: list[int], seq_len: int) -> PackedExamples:
        n = sum(lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return PackedExamples(np.zeros(n, np.uint16), np.ones(n, np.uint8), offsets, seq_len=seq_len)

    train, val = packed([9, 70, 30, 188, 12], 64), packed([66, 5], 64)
    assert truncation_warning(train, val, 64) == (
        "pretrain | warning: 3 of 7 examples (43%) are longer than train.seq_len=64 and are cut there, "
        "their ends not learned; train.seq_len=187 keeps every one"
    )
    assert truncation_warning(packed([9, 70, 188], 187), packed([66], 187), 187) == ""


def _chat_jsonl(path: Path, n: int = 160) -> Path:
    """Chats made from Python's own help topics: the answer is the topic's first lines."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    with open(path, "w") as f:
        for i in range(n):
            name = names[i % len(names)]
            answer = " ".join(topics[name].split()[: 25 + i % 20])
            chat = [{"role": "user", "content": f"Explain {name}."}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                chat = [
                    {"role": "system", "content": "You document Python."},
                    *chat,
                    {"role": "user", "content": "More?"},
                    {"role": "assistant", "content": name},
                ]
            rec = {"messages": chat} if i % 4 else {"prompt": f"Explain {name}.\n", "completion": answer}
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.mark.parametrize("n_chats_of_8", [6, 2])
def test_eval_prompts_a_chat_fine_tune_as_a_user_turn(
    tokenizer_dir: Path, make_tiny_cfg, tmp_path: Path, cache_dir: Path, n_chats_of_8: int
) -> None:
    """``llmctl eval``'s samples of a chat fine-tune (most examples chat messages) give the prompt as
    the chat template renders a user turn with its generation prompt, what transformers'
    ``apply_chat_template`` gives; a prompt/completion fine-tune's prompt is encoded as its training
    prompts were (issue #34, item 10)."""
    transformers = pytest.importorskip("transformers")
    from workloads.pretrain.data.cache import prepare_corpus
    from workloads.pretrain.evaluate import samples
    from workloads.pretrain.model.transformer import build_model

    data = tmp_path / "mixed.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            q, a = f"Question {i}?", f"Answer {i}."
            chat = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": chat} if i < n_chats_of_8 else {"prompt": q, "completion": a}) + "\n")
    cfg = make_tiny_cfg(
        **{
            "data.cache_dir": str(cache_dir),
            "data.source": str(data),
            "data.format": "sft",
            "data.name": f"mixed{n_chats_of_8}",
            "data.tokenizer": str(tokenizer_dir),
            "model.vocab_size": VOCAB,
            "eval.prompts": ["What is a tuple?"],
            "eval.max_new_tokens": 3,
        }
    )
    corpus = prepare_corpus(cfg.data)
    torch.manual_seed(0)
    (sample,) = samples(build_model(cfg.model).eval(), corpus, cfg.eval, torch.device("cpu"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if n_chats_of_8 >= 4:
        want = hf.apply_chat_template([{"role": "user", "content": "What is a tuple?"}], add_generation_prompt=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
    else:
        want = hf("What is a tuple?")["input_ids"]  # BOS + the text, as prompt/completion trained
    assert sample["prompt_ids"] == want, (sample["prompt_ids"], want)
    assert sample["greedy"] and sample["sampled"] and 0 < len(sample["greedy_ids"]) <= 3  # the new tokens


@pytest.mark.slow
def test_sft_loss_falls_and_two_ranks_or_micro_batches_reproduce_one(
    tokenizer_dir, workload, tmp_path, cache_dir
) -> None:
    """Masked, packed fine-tuning: the loss falls, and FSDP over 2 ranks, or 2 micro-batches of 2,
    give the single process's losses (train and val, every step) within 1e-5: the loss is the mean
    over the global batch's targets, not a mean of per-rank or per-micro-batch means (they hold
    different numbers of targets)."""
    from omegaconf import OmegaConf

    data = _chat_jsonl(tmp_path / "chats.jsonl")
    cfg = tmp_path / "sft.yaml"
    OmegaConf.save(
        workload.cfg(
            **{
                "data.cache_dir": str(cache_dir),
                "data.source": str(data),
                "data.format": "sft",
                "data.name": "chats",
                "data.tokenizer": str(tokenizer_dir),
                "data.val_fraction": 0.1,
                "model.vocab_size": VOCAB,
                "train.steps": 8,
                "train.batch_size": 4,
                "train.seq_len": 96,
                "train.log_every": 1,
                "train.val_every": 4,
                "train.lr": 3e-3,
                "train.warmup_steps": 2,
            }
        ),
        cfg,
    )
    one = workload.run(["--config", str(cfg)], loss_env(tmp_path / "one.jsonl"))
    assert one.returncode == 0, one.stderr[-4000:]
    assert "examples packed into" in one.stdout, one.stdout
    two = workload.run(
        ["--config", str(cfg), "parallel.dp_shard=2"], loss_env(tmp_path / "two.jsonl"), launcher=workload.torchrun(2)
    )
    assert two.returncode == 0, two.stderr[-4000:]
    micro = workload.run(["--config", str(cfg), "train.micro_batch_size=2"], loss_env(tmp_path / "micro.jsonl"))
    assert micro.returncode == 0 and "(2 micro-batches of 2 per rank)" in micro.stdout, micro.stderr[-4000:]
    ref = workload.loss_file(tmp_path / "one.jsonl")
    assert sorted(ref["train"]) == list(range(1, 9)) and sorted(ref["val"]) == [0, 4, 8]
    for other in ("two", "micro"):
        got = workload.loss_file(tmp_path / f"{other}.jsonl")
        for kind in ("train", "val"):
            assert sorted(got[kind]) == sorted(ref[kind])
            diffs = {step: abs(got[kind][step] - loss) for step, loss in ref[kind].items()}
            assert max(diffs.values()) <= 1e-5, (other, kind, diffs)
    assert ref["val"][8] < ref["val"][0] - 0.3, ref["val"]
    train = [ref["train"][s] for s in sorted(ref["train"])]
    assert np.mean(train[-3:]) < np.mean(train[:3]) - 0.3, train


def test_a_chat_preference_pair_learns_its_answers_not_the_prompts_turns(tokenizer_dir: Path) -> None:
    """DPO's chat records (TRL's conversational format): each answer after the same prompt, the
    targets what TRL calls the completion (the conversation rendered with the answer, past the prompt
    rendered with its generation prompt), so an assistant turn inside the prompt is not learned."""
    import transformers
    from tokenizers import Tokenizer

    from workloads.pretrain.data.chat import encode_pair, load_chat_template

    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompt = CHATS[1][:4]  # system, user, assistant, user: an earlier answer in the prompt
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "A mapping of keys to values."}],
        "rejected": [{"role": "assistant", "content": "A list."}],
    }
    chosen, rejected, prompt_tokens = encode_pair(
        record, tok, tok.token_to_id("<|eot_id|>"), load_chat_template(str(tokenizer_dir)), "p.jsonl:1"
    )
    head = list(
        hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    assert prompt_tokens == len(head)
    for (ids, mask), answer in ((chosen, record["chosen"]), (rejected, record["rejected"])):
        whole = list(hf.apply_chat_template(prompt + answer, tokenize=True, return_dict=True)["input_ids"])
        assert ids.tolist() == whole and whole[: len(head)] == head
        assert mask.tolist() == [0] * len(head) + [1] * (len(whole) - len(head))
