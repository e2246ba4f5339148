"""Four tiny BERT classifiers trained by the Hugging Face Trainer as one stack (newcomer task 5).

`PhalanxTrainer` is the real `transformers.Trainer`, subclassed: each member is clipped with
its own gradient norm, its loss and evaluation loss are logged per member
(`loss/member_i`, `eval_loss/member_i`), and `save_model` writes one `save_pretrained` folder
per member. Each step runs captured by `phalanx.compile_step` where that measures faster
(`step="auto"`, the default; `trainer.step_choice` says which). Needs `pip install 'phalanx[hf]'`. Run: python docs/guides/hf_trainer.py
"""

import tempfile
import warnings

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
from transformers.utils import logging

import phalanx
from phalanx.integrations.transformers import PhalanxTrainer

warnings.filterwarnings("ignore", module="transformers|accelerate")  # notes on a CPU run
logging.set_verbosity_error()
logging.disable_progress_bar()
N = 4


class Sentences(Dataset):
    """Token ids whose label is whether token 7 occurs: a task a tiny BERT learns."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, 64, (n, 12), generator=g)
        self.ids[: n // 2, 3] = 7
        self.labels = (self.ids == 7).any(1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


config = BertConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=16, num_labels=2,
)  # fmt: skip
torch.manual_seed(0)
stack = phalanx.stack([BertForSequenceClassification(config) for _ in range(N)])
out = tempfile.mkdtemp()
args = TrainingArguments(
    out, max_steps=40, per_device_train_batch_size=16, learning_rate=3e-3, max_grad_norm=1.0,
    logging_steps=40, eval_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
)  # fmt: skip
trainer = PhalanxTrainer(
    model=stack, args=args, train_dataset=Sentences(128, 0), eval_dataset=Sentences(64, 1)
)
trainer.train()
print("step:", trainer.step_choice)  # "captured" where it measured faster, else "eager"
metrics = trainer.evaluate()
print(
    "eval loss per member:", " ".join(f"{metrics[f'eval_loss/member_{i}']:.3f}" for i in range(N))
)

trainer.save_model(out)  # out/member_0/ ... out/member_3/: one save_pretrained folder each
member = BertForSequenceClassification.from_pretrained(f"{out}/member_2")
print("member_2/ loads with from_pretrained:", type(member).__name__)

predictions = trainer.predict(Sentences(8, 2)).predictions  # members first, as stack(x) returns
print("predictions:", predictions.shape)  # (N, B, num_labels): (4, 8, 2)
