"""Eight GPT-2s trained by the Hugging Face Trainer as one stack, each member on its own.

PhalanxTrainer clips each member with its own norm (max_grad_norm=1.0), logs each member's
loss, and writes one save_pretrained folder per member that from_pretrained reads back.
"""

import tempfile
import warnings

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging

import phalanx
from phalanx.integrations.transformers import PhalanxTrainer

warnings.filterwarnings("ignore")  # the Trainer's notes about a tiny CPU run
logging.set_verbosity_error()
logging.disable_progress_bar()
torch.set_num_threads(1)


class Tokens(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, use_cache=False)
stack = phalanx.stack([GPT2LMHeadModel(config) for _ in range(8)])
out = tempfile.mkdtemp()
args = TrainingArguments(out, max_steps=8, per_device_train_batch_size=8, learning_rate=1e-3,
                         logging_steps=8, report_to=[], use_cpu=True, disable_tqdm=True)  # fmt: skip
trainer = PhalanxTrainer(model=stack, args=args, train_dataset=Tokens())
trainer.train()
last = trainer.state.log_history[-2]
print("per-member losses:", " ".join(f"{last[f'loss/member_{i}']:.3f}" for i in range(8)))
trainer.save_model(out)
member = GPT2LMHeadModel.from_pretrained(f"{out}/member_3")
trained = stack.unstack()[3].state_dict()
same = all(torch.equal(v, trained[k]) for k, v in member.state_dict().items())
print(f"member_3/ read back with from_pretrained holds the trained member 3's weights: {same}")
