"""A user's own transformers ``Trainer`` script, written against llmctl's run contract
(docs/workloads.md) and nothing else of llmctl: it reads ``LLMCTL_CHECKPOINT_DIR`` and
``LLMCTL_RESUME``, reports to MLflow with transformers' own callback (which logs into the run named
by ``MLFLOW_RUN_ID``), saves and exits 75 on SIGTERM, and continues from its newest complete checkpoint
(one whose ``trainer_state.json``, the Trainer's last file of a save, is there: a SIGKILL after the
SIGTERM, as Slurm sends once its grace is over, can cut a save short).

    python hf_trainer.py --model DIR [--learning_rate 1e-3] [--max_steps 12] [--save_steps 4]
        [--contract_report FILE]

``--contract_report``: write what the contract gave this start to FILE (JSON): the run folder
(``LLMCTL_RUN_DIR``), whether the resolved config is in it, and a digest of ``LLMCTL_TEST_API_KEY``
(a secret forwarded with ``workload.secrets``; never the value itself).

The data: fixed random token sequences (no download), the same on every start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--max_steps", type=int, default=12)
parser.add_argument("--save_steps", type=int, default=4)
parser.add_argument("--step_sleep", type=float, default=0.0)  # slows each step: time for a test to stop it
parser.add_argument("--contract_report", default="")
args = parser.parse_args()

if args.contract_report:
    run_dir = os.environ.get("LLMCTL_RUN_DIR", "")
    key = os.environ.get("LLMCTL_TEST_API_KEY", "")
    report = {
        "run_dir": run_dir,
        "config": bool(run_dir) and (Path(run_dir) / "config.yaml").is_file(),
        "key_sha256": hashlib.sha256(key.encode()).hexdigest()[:16] if key else None,
    }
    Path(args.contract_report).write_text(json.dumps(report))

stop = {"asked": False}
signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(asked=True))


class SaveAndStopOnSigterm(transformers.TrainerCallback):
    """The contract's stop: on SIGTERM, save at the end of this step and leave training."""

    def on_step_end(self, targs, state, control, **kwargs):
        time.sleep(args.step_sleep)
        if stop["asked"]:
            control.should_save = True
            control.should_training_stop = True
        return control


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 256, seq: int = 16) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


out = os.environ["LLMCTL_CHECKPOINT_DIR"]
targs = transformers.TrainingArguments(
    output_dir=out,
    max_steps=args.max_steps,
    per_device_train_batch_size=4,
    learning_rate=args.learning_rate,
    logging_steps=1,
    save_steps=args.save_steps,
    save_total_limit=2,
    report_to=["mlflow"],
    use_cpu=True,
    seed=0,
    dataloader_num_workers=0,
)
model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
trainer = transformers.Trainer(
    model=model, args=targs, train_dataset=Tokens(model.config.vocab_size), callbacks=[SaveAndStopOnSigterm()]
)


def newest_complete_checkpoint(root: str) -> str | None:
    done = [d for d in Path(root).glob("checkpoint-*") if (d / "trainer_state.json").is_file()]
    return str(max(done, key=lambda d: int(d.name.split("-")[1]))) if done else None


resume = newest_complete_checkpoint(out) if os.environ.get("LLMCTL_RESUME") == "1" else None
trainer.train(resume_from_checkpoint=resume)
print(f"program | stopped at step {trainer.state.global_step}" if stop["asked"] else "program | done", flush=True)
sys.exit(75 if stop["asked"] else 0)
