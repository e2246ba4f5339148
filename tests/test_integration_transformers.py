"""phalanx.integrations.transformers.PhalanxTrainer driving the real Trainer, against each
member trained alone by a plain transformers.Trainer with the same data and seed."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import phalanx

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from phalanx.integrations.transformers import MemberEarlyStopping, PhalanxTrainer  # noqa: E402

N = 3
CONFIG = transformers.GPT2Config(
    vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
)  # fmt: skip


class Ids(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 40, (10,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def gpt2s():
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(transformers.GPT2LMHeadModel(CONFIG))
    return out


class Scaled(nn.Module):
    """A model whose loss is multiplied, so that its gradient explodes: alone or stacked."""

    def __init__(self, model, scale):
        super().__init__()
        self.model = model
        self.register_buffer("scale", torch.as_tensor(scale))

    def forward(self, input_ids, labels):
        return {"loss": self.model(input_ids, labels=labels).loss * self.scale}


def _args(tmp_path, **kw):
    settings = {
        "output_dir": str(tmp_path), "max_steps": 3, "per_device_train_batch_size": 4,
        "report_to": [], "save_strategy": "no", "use_cpu": True, "disable_tqdm": True,
        "logging_steps": 1, "optim": "adamw_torch", "learning_rate": 1e-2,
    }  # fmt: skip
    settings.update(kw)
    return transformers.TrainingArguments(**settings)


SCALE = [1.0, 1.0, 1e4]  # member 2's gradient explodes: the default max_grad_norm=1.0 clips it


@pytest.mark.parametrize("form", ["wrapped_exploding", "stack_itself"])
def test_the_trainer_with_one_member_exploding_steps_the_others_exactly_as_alone(tmp_path, form):
    # wrapped_exploding: a module around the stack scales member 2's loss by 1e4 (the default
    # max_grad_norm=1.0 clips it hard); stack_itself: the stack of GPT-2s is the Trainer's
    # model, as a GPT-2 alone is (labels, num_items_in_batch, use_cache read off the members)
    wrapped = form == "wrapped_exploding"
    members = gpt2s()
    alone, alone64, logged = [], [], []
    for i, m in enumerate(members):
        for dtype, out in ((torch.float32, alone), (torch.float64, alone64)):
            member = copy.deepcopy(m).to(dtype)
            model = Scaled(member, SCALE[i]) if wrapped else member
            trainer = transformers.Trainer(model=model, args=_args(tmp_path), train_dataset=Ids())
            trainer.train()
            out.append(member)
            if dtype == torch.float32:
                logged.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    stack = phalanx.stack(members, backend="loop")
    model = Scaled(stack, torch.tensor(SCALE)) if wrapped else stack
    trainer = PhalanxTrainer(model=model, args=_args(tmp_path), train_dataset=Ids())
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, phalanx.optim.AdamW)
    for i, member in enumerate(stack.unstack()):
        pairs = zip(member.named_parameters(), alone[i].parameters(), alone64[i].parameters())
        for (name, p), q, q64 in pairs:
            # phalanx.clip_grad_norm_ sums squares in another order than torch's foreach norm
            phalanx.testing.assert_equal_to_loop(p, q, q64, what=f"member {i} {name}")
        ours = [h[f"loss/member_{i}"] for h in trainer.state.log_history if "loss" in h]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logged[i]))
    if wrapped:  # member 2 did explode, and members 0 and 1 stepped as alone
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert min(h["grad_norm/member_2"] / h["grad_norm/member_0"] for h in logs) > 1e3


@pytest.mark.parametrize("step", ["eager", "captured"])
def test_checkpoints_hold_one_save_pretrained_folder_per_member_and_resume_exactly(tmp_path, step):
    # captured: the run's steps after compile_step's warm-up are captured, the resumed run's
    # steps 3 to 5 eager then captured: equal to float rounding, not bit for bit
    def run(out, steps, resume=None):
        stack = phalanx.stack(gpt2s(), backend="loop")
        args = _args(out, max_steps=steps, save_strategy="steps", save_steps=2, max_grad_norm=0.5)
        trainer = PhalanxTrainer(
            model=stack, args=args, train_dataset=Ids(), step=step, step_backend="aot_eager"
        )
        trainer.train(resume_from_checkpoint=resume)
        return stack, trainer

    whole, trainer = run(tmp_path / "a", 5)  # tied weights: the Trainer's own save crashed
    assert trainer.step_choice == step
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert {"member_0", "member_1", "member_2", "phalanx.safetensors", "optimizer.pt"} <= set(
        os.listdir(checkpoint)
    )
    resumed, _ = run(tmp_path / "b", 5, resume=str(checkpoint))
    for p, q in zip(whole.parameters(), resumed.parameters()):
        if step == "eager":
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q)
    trainer.save_model(str(tmp_path / "final"))
    for i, member in enumerate(whole.unstack()):
        back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final" / f"member_{i}")
        for (name, p), q in zip(member.state_dict().items(), back.state_dict().values()):
            assert torch.equal(p, q), f"member {i} {name}"


def test_member_early_stopping_masks_a_stopped_member_and_metrics_are_per_member(tmp_path):
    stack = phalanx.stack(gpt2s(), backend="loop")
    opt = phalanx.optim.AdamW(stack.parameters(), lr=[1e-3, 3.0, 1e-3])  # member 1 diverges

    def accuracy(prediction):
        logits, labels = prediction.predictions, prediction.label_ids
        assert logits.shape[1:] == (10, 40)  # one member's (B, T, vocab)
        return {"acc": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}

    stopper = MemberEarlyStopping(patience=1)
    args = _args(tmp_path, max_steps=12, eval_strategy="steps", eval_steps=2, max_grad_norm=0.0)
    trainer = PhalanxTrainer(
        model=stack, args=args, train_dataset=Ids(), eval_dataset=Ids(), optimizers=(opt, None),
        compute_metrics=accuracy, callbacks=[stopper], step_backend="aot_eager",
    )  # fmt: skip
    snapshots = {}

    class Snapshot(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = [p[1].detach().clone() for p in stack.parameters()]

    trainer.add_callback(Snapshot())
    trainer.train()
    assert stopper.stopped[1] and not stopper.stopped[0] and not stopper.stopped[2]
    evals = [h for h in trainer.state.log_history if "eval_loss/member_1" in h]
    stop_step = next(
        h["step"] for h in evals[1:] if h["eval_loss/member_1"] >= evals[0]["eval_loss/member_1"]
    )
    later = max(snapshots)
    assert all(torch.equal(a, b) for a, b in zip(snapshots[stop_step], snapshots[later]))
    steps = trainer.optimizer.optimizer.state[next(iter(stack.parameters()))]["step"].tolist()
    assert steps[1] == stop_step and steps[0] == steps[2] == later
    # compute_metrics ran on each member's own predictions
    x = torch.stack([Ids()[i]["input_ids"] for i in range(16)])
    with torch.no_grad():
        own = stack.unstack()[2](x).logits
    assert evals[-1]["eval_acc/member_2"] == pytest.approx(
        float((own[:, :-1].argmax(-1) == x[:, 1:]).float().mean())
    )


def test_fp16_loss_scaling_through_the_trainer_skips_only_the_overflowing_member(tmp_path):
    # accelerate builds its GradScaler for fp16 on a GPU only: on the CPU, give the trainer's
    # accelerator the per-member scaler it builds there, and inject one member's overflow
    members = gpt2s()
    scale = torch.tensor([1.0, float("inf"), 1.0])
    stacked = Scaled(phalanx.stack(copy.deepcopy(members), backend="loop"), scale)
    trainer = PhalanxTrainer(
        model=stacked, args=_args(tmp_path, max_steps=1, max_grad_norm=0.0), train_dataset=Ids()
    )
    trainer.accelerator.scaler = phalanx.MemberGradScaler(N, device="cpu", init_scale=2.0**8)
    trainer.train()
    assert trainer.accelerator.scaler.get_scale().tolist() == [2.0**8, 2.0**7, 2.0**8]
    after = stacked.model.unstack()
    for i in (0, 2):
        model = Scaled(copy.deepcopy(members[i]), 1.0)
        transformers.Trainer(
            model=model, args=_args(tmp_path, max_steps=1, max_grad_norm=0.0), train_dataset=Ids()
        ).train()
        assert all(
            torch.equal(p, q) for p, q in zip(after[i].parameters(), model.model.parameters())
        )
    assert all(torch.equal(p, q) for p, q in zip(after[1].parameters(), members[1].parameters()))


def test_what_would_couple_the_members_is_refused_naming_the_fix(tmp_path):
    stack = phalanx.stack(gpt2s())
    with pytest.raises(
        ValueError, match=r"optimizer is a AdamW, whose step cannot leave out.*phalanx.optim.AdamW"
    ):
        PhalanxTrainer(
            model=stack,
            args=_args(tmp_path),
            optimizers=(torch.optim.AdamW(stack.parameters()), None),
        )
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0.1.*phalanx.member_losses"):
        PhalanxTrainer(model=stack, args=_args(tmp_path, label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match=r"reduce_lr_on_plateau.*MemberScheduler"):
        PhalanxTrainer(
            model=stack,
            args=_args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps"),
            eval_dataset=Ids(),
        )
    with pytest.raises(ValueError, match=r"optim='adafactor' has no phalanx optimizer"):
        PhalanxTrainer(model=stack, args=_args(tmp_path, optim="adafactor"))
    with pytest.raises(ValueError, match=r"model must hold a phalanx stack.*got GPT2LMHeadModel"):
        PhalanxTrainer(model=gpt2s()[0], args=_args(tmp_path))

    class Summed(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = stack

        def forward(self, input_ids, labels):
            return {"loss": self.stack(input_ids, labels=labels, use_cache=False).loss.sum()}

    trainer = PhalanxTrainer(model=Summed(), args=_args(tmp_path), train_dataset=Ids())
    with pytest.raises(
        ValueError, match=r"loss must be the per-member losses, shape \(3,\).*got \(\)"
    ):
        trainer.train()


def test_a_resumed_run_restores_which_members_stopped(tmp_path):
    def trainer(out, steps, stopper):
        stack = phalanx.stack(gpt2s(), backend="loop")
        opt = phalanx.optim.AdamW(stack.parameters(), lr=[1e-3, 3.0, 1e-3])  # member 1 diverges
        args = _args(
            out,
            max_steps=steps,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=6,
        )
        return stack, PhalanxTrainer(
            model=stack, args=args, train_dataset=Ids(), eval_dataset=Ids(), optimizers=(opt, None),
            callbacks=[stopper], step_backend="aot_eager",
        )  # fmt: skip

    _, first = trainer(tmp_path / "a", 6, MemberEarlyStopping(patience=1))
    first.train()
    assert first.member_mask().tolist() == [True, False, True]
    stack, resumed = trainer(tmp_path / "b", 8, MemberEarlyStopping(patience=1))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-6"))
    assert resumed.member_mask().tolist() == [True, False, True]  # restored, not re-learned
    loaded = phalanx.stack(gpt2s(), backend="loop")
    phalanx.load(tmp_path / "a" / "checkpoint-6" / "phalanx.safetensors", loaded)
    # steps 7 and 8 moved members 0 and 2 on from the checkpoint and left member 1 there
    assert all(torch.equal(p[1], q[1]) for p, q in zip(stack.parameters(), loaded.parameters()))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(stack.parameters(), loaded.parameters()))


def test_logged_loss_is_the_members_mean_as_eval_loss_and_predict_is_members_first(tmp_path):
    stack = phalanx.stack(gpt2s(), backend="loop")
    args = _args(
        tmp_path, max_steps=4, logging_steps=4, learning_rate=0.0
    )  # one epoch, weights stay
    trainer = PhalanxTrainer(
        model=stack, args=args, train_dataset=Ids(), eval_dataset=Ids(), step_backend="aot_eager"
    )
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    members = [logged[f"loss/member_{i}"] for i in range(N)]
    assert logged["loss"] == pytest.approx(sum(members) / N, rel=1e-4)
    metrics = trainer.evaluate()
    evals = [metrics[f"eval_loss/member_{i}"] for i in range(N)]
    assert metrics["eval_loss"] == pytest.approx(sum(evals) / N, rel=1e-5)
    # with lr 0 the eval set (the train set) gives each member its logged training loss
    assert evals == pytest.approx(members, rel=1e-4)
    out = trainer.predict(Ids())
    assert out.predictions.shape[:2] == (N, len(Ids()))  # (N, B, T, V), as stack(x) returns
    x = torch.stack([Ids()[i]["input_ids"] for i in range(4)])
    with torch.no_grad():
        direct = stack(x).logits
    torch.testing.assert_close(torch.from_numpy(out.predictions[:, :4]), direct)
    assert out.label_ids.shape == (len(Ids()), 10)


def test_save_model_leaves_no_lock_file_in_the_model_folder(tmp_path):
    stack = phalanx.stack(gpt2s(), backend="loop")
    trainer = PhalanxTrainer(model=stack, args=_args(tmp_path, max_steps=1), train_dataset=Ids())
    trainer.save_model(str(tmp_path / "final"))
    names = os.listdir(tmp_path / "final")
    assert "phalanx.safetensors" in names
    assert not [n for n in names if n.endswith(".lock") or n.startswith(".")], names


@pytest.mark.parametrize("member_data", ["shuffle", "bootstrap"])
def test_member_data_gives_each_member_its_own_order_as_a_plain_trainer_on_it(
    tmp_path, member_data
):
    steps, batch = 6, 4  # 4 batches an epoch: the orders of epochs 0 and 1
    members = gpt2s()
    stack = phalanx.stack(copy.deepcopy(members), backend="loop")
    args = _args(tmp_path, max_steps=steps, seed=5)
    trainer = PhalanxTrainer(
        model=stack, args=args, train_dataset=Ids(), member_data=member_data, step="captured",
        step_backend="aot_eager",
    )  # fmt: skip
    trainer.train()
    assert trainer.step_choice == "captured"  # per-member batches and counts, in the graph
    orders = phalanx.data.MemberLoader(
        torch.arange(len(Ids())), num_members=N, batch_size=batch,
        bootstrap=member_data == "bootstrap", seed=5,
    )  # fmt: skip
    walked = torch.cat([orders.order(0), orders.order(1)], dim=1)  # (N, 32)
    assert not torch.equal(walked[0], walked[1])

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    for i, member in enumerate(stack.unstack()):
        data = torch.utils.data.Subset(Ids(), walked[i].tolist())
        alone = [copy.deepcopy(members[i]).to(dtype) for dtype in (torch.float32, torch.float64)]
        for m in alone:
            InOrder(
                model=m, args=_args(tmp_path, max_steps=steps, seed=5), train_dataset=data
            ).train()
        pairs = zip(member.named_parameters(), alone[0].parameters(), alone[1].parameters())
        for (name, p), q, q64 in pairs:
            phalanx.testing.assert_equal_to_loop(p, q, q64, what=f"member {i} {name}")


def test_member_data_needs_the_stack_itself_and_a_known_order(tmp_path):
    stack = phalanx.stack(gpt2s(), backend="loop")
    with pytest.raises(ValueError, match=r"member_data='own'.*'shuffle'"):
        PhalanxTrainer(model=stack, args=_args(tmp_path), train_dataset=Ids(), member_data="own")
    wrapped = Scaled(stack, torch.ones(N))
    with pytest.raises(ValueError, match=r"must be the stack itself"):
        PhalanxTrainer(model=wrapped, args=_args(tmp_path), member_data="shuffle")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_captured_step_trains_each_member_as_alone_with_one_member_diverging(tmp_path, backend):
    # the stack itself as model, member 1's weights non-finite from the start: its loss and
    # gradients are NaN, and members 0 and 2 go on as a plain Trainer trains them alone,
    # captured after compile_step's eager warm-up steps
    members = gpt2s()
    with torch.no_grad():
        members[1].transformer.wte.weight[0, 0] = float("nan")
    steps = 6
    alone = {}
    for i in (0, 2):
        for dtype in (torch.float32, torch.float64):
            m = copy.deepcopy(members[i]).to(dtype)
            transformers.Trainer(
                model=m, args=_args(tmp_path, max_steps=steps), train_dataset=Ids()
            ).train()
            alone[i, dtype] = m
    stack = phalanx.stack(copy.deepcopy(members), backend="loop")
    trainer = PhalanxTrainer(
        model=stack, args=_args(tmp_path, max_steps=steps), train_dataset=Ids(),
        step="captured", step_backend=backend,
    )  # fmt: skip
    trainer.train()
    assert trainer.step_choice == "captured"
    logs = [h for h in trainer.state.log_history if "loss/member_0" in h]
    flags = [h.get("captured_step") for h in logs]  # said once, at the capture
    assert flags.count(1.0) == 1 and flags.count(None) == len(flags) - 1
    assert all(h["loss/member_1"] != h["loss/member_1"] for h in logs)  # NaN all along
    out = stack.unstack()
    for i in (0, 2):
        pairs = zip(
            out[i].named_parameters(),
            alone[i, torch.float32].parameters(),
            alone[i, torch.float64].parameters(),
        )
        for (name, p), q, q64 in pairs:
            phalanx.testing.assert_equal_to_loop(p, q, q64, what=f"member {i} {name}")


def test_the_step_choice_is_said_and_the_trainers_own_step_runs_where_capture_cannot(tmp_path):
    stack = phalanx.stack(gpt2s(), backend="loop")
    trainer = PhalanxTrainer(
        model=stack, args=_args(tmp_path, max_steps=16), train_dataset=Ids(),
        step_backend="aot_eager",
    )  # fmt: skip
    assert trainer.step_mode == "auto" and trainer.step_choice is None
    trainer.train()  # the warm-up, the capture, then captured and eager alternating: decided
    assert trainer.step_choice in ("captured", "eager")
    logged = [h["captured_step"] for h in trainer.state.log_history if "captured_step" in h]
    assert logged == [float(trainer.step_choice == "captured")]
    # a module around the stack computes the loss itself: the Trainer's own step, said
    wrapped = Scaled(phalanx.stack(gpt2s(), backend="loop"), torch.ones(N))
    trainer = PhalanxTrainer(model=wrapped, args=_args(tmp_path, max_steps=1), train_dataset=Ids())
    assert "around the stack" in trainer.why_eager()
    trainer.train()
    assert trainer.step_choice == "eager"
    with pytest.raises(ValueError, match=r"step='captured'.*around the stack.*step='auto'"):
        PhalanxTrainer(
            model=wrapped, args=_args(tmp_path, max_steps=1), train_dataset=Ids(),
            step="captured",
        ).train()  # fmt: skip
    with pytest.raises(ValueError, match=r"step must be 'auto'"):
        PhalanxTrainer(model=stack, args=_args(tmp_path), step="fast")
    accumulating = PhalanxTrainer(
        model=stack, args=_args(tmp_path, gradient_accumulation_steps=2), train_dataset=Ids()
    )
    assert "gradient_accumulation_steps=2" in accumulating.why_eager()
