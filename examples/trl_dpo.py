"""TRL's own DPO under llmctl (``workload=command``): the same preference pairs, TRL's trainer.

    llmctl launch workload=command workload.run='python3 examples/trl_dpo.py --model DIR --data pairs.jsonl'

The script keeps llmctl's run contract (docs/workloads.md): checkpoints in ``$LLMCTL_CHECKPOINT_DIR``,
SIGTERM saves at the step it is on and exits 75, ``LLMCTL_RESUME=1`` continues from the newest
complete checkpoint, metrics go to the run through transformers' MLflow callback (TRL's names:
``rewards/accuracies``, ``rewards/margins``, ...). The bundled trainer does the same work with
``train.objective=dpo`` (docs/finetune.md); this is for a recipe TRL has and it has not.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import transformers
from datasets import load_dataset
from trl import DPOConfig, DPOTrainer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory (with its tokenizer)")
parser.add_argument("--data", required=True, help=".jsonl of prompt/chosen/rejected records")
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--max_steps", type=int, default=20)
parser.add_argument("--learning_rate", type=float, default=5e-4)
args = parser.parse_args()

stop = {"asked": False}
signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(asked=True))


class SaveAndStopOnSigterm(transformers.TrainerCallback):
    def on_step_end(self, targs, state, control, **kwargs):
        if stop["asked"]:
            control.should_save = control.should_training_stop = True
        return control


def newest_complete_checkpoint(root: str) -> str | None:
    done = [d for d in Path(root).glob("checkpoint-*") if (d / "trainer_state.json").is_file()]
    return str(max(done, key=lambda d: int(d.name.split("-")[1]))) if done else None


out = os.environ["LLMCTL_CHECKPOINT_DIR"]
config = DPOConfig(
    output_dir=out,
    beta=args.beta,
    max_steps=args.max_steps,
    learning_rate=args.learning_rate,
    per_device_train_batch_size=4,
    logging_steps=1,
    save_steps=10,
    save_total_limit=2,
    report_to=["mlflow"],
    use_cpu=True,  # drop on a GPU machine (and bf16=False below)
    bf16=False,
    gradient_checkpointing=False,
    seed=0,
)
tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
trainer = DPOTrainer(
    model=transformers.AutoModelForCausalLM.from_pretrained(args.model),
    args=config,
    train_dataset=load_dataset("json", data_files=args.data, split="train"),
    processing_class=tokenizer,
    callbacks=[SaveAndStopOnSigterm()],
)
resume = newest_complete_checkpoint(out) if os.environ.get("LLMCTL_RESUME") == "1" else None
trainer.train(resume_from_checkpoint=resume)
print(f"trl_dpo | stopped at step {trainer.state.global_step}" if stop["asked"] else "trl_dpo | done", flush=True)
sys.exit(75 if stop["asked"] else 0)
