"""phalanx.integrations.lightning driven by the real pytorch_lightning.Trainer."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

pl = pytest.importorskip("pytorch_lightning")
from safetensors.torch import load_file  # noqa: E402

from phalanx.integrations.lightning import (  # noqa: E402
    MemberCheckpoint,
    MemberEarlyStopping,
    StackModule,
    check_trainer,
)

N = 4
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
SCALE = [1.0, 1.0, 1.0, 1e4]  # member 3 explodes


def make():
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1))


def trainer(**kw):
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False, **kw
    )


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        warnings.filterwarnings("ignore", module="lightning_fabric")
        yield


class Ensemble(StackModule):
    def __init__(self, backend="loop", lrs=LRS, scale=SCALE):
        super().__init__()
        self.save_hyperparameters()
        self.stack = phalanx.stack(make, num_members=N, seed=0, backend=backend)
        self.scale = torch.tensor(scale)

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = phalanx.member_losses(F.cross_entropy, self.stack(x), y) * self.scale
        self.log_members("train_loss", losses)
        return losses.sum()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log_members("val_loss", phalanx.member_losses(F.cross_entropy, self.stack(x), y))

    def configure_optimizers(self):
        return phalanx.optim.Adam(self.stack.parameters(), lr=list(self.hparams.lrs))


class Alone(pl.LightningModule):
    """Member i as an ordinary module in Lightning's plain loop."""

    def __init__(self, i):
        super().__init__()
        torch.manual_seed(i)  # phalanx.stack(seed=0) builds member i after manual_seed(0 + i)
        self.net = make()
        self.i = i

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y) * SCALE[self.i]

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=LRS[self.i])


def fit_stack(backend, scale, steps=5, clip=1.0):
    model = Ensemble(backend=backend, scale=scale)
    trainer(max_steps=steps, gradient_clip_val=clip).fit(model, DataLoader(data(), batch_size=16))
    return model


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_an_exploding_member_leaves_the_others_bit_for_bit(backend):
    """Trainer(gradient_clip_val=1.0), member 3's loss 1e4 times larger: members 0-2 end bit
    for bit where they end when member 3 trains normally (its norm is clipped on its own)."""
    exploding = fit_stack(backend, SCALE)
    calm = fit_stack(backend, [1.0] * N)
    assert exploding.last_grad_norms[3] > 1e3 > calm.last_grad_norms[3]
    for i in range(N - 1):
        for k, v in phalanx.export_members(calm.stack, [i])[0].items():
            got = phalanx.export_members(exploding.stack, [i])[0][k]
            assert torch.equal(got, v), f"member {i} {k} moved by member 3's explosion"
    w = phalanx.export_members(exploding.stack, [3])[0]["0.weight"]
    assert not torch.equal(w, phalanx.export_members(calm.stack, [3])[0]["0.weight"])


def test_members_match_lightning_training_each_alone():
    """Each member against the same module trained alone by Lightning's plain loop
    (Trainer(gradient_clip_val=1.0) -> torch.nn.utils.clip_grad_norm_, torch.optim.Adam):
    one clipped step under the project's rounding rule (float64 loop as reference), then five
    steps within the trajectory screen (assert_close; the member-3 explosion included)."""
    x, y = data(16).tensors
    for steps in (1, 5):
        model = fit_stack("loop", SCALE, steps=steps)
        for i in range(N):
            alone = Alone(i)
            trainer(max_steps=steps, gradient_clip_val=1.0).fit(
                alone, DataLoader(data(), batch_size=16)
            )
            got = phalanx.export_members(model.stack, [i])[0]
            if steps == 5:
                for k, v in alone.net.state_dict().items():
                    phalanx.testing.assert_close(got[k], v, msg=f"member {i} {k}", trajectory=True)
                continue
            torch.manual_seed(i)
            ref = make().double()
            F.cross_entropy(ref(x.double()), y).mul(SCALE[i]).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            torch.optim.Adam(ref.parameters(), lr=LRS[i]).step()
            for k, v in alone.net.state_dict().items():
                phalanx.testing.assert_equal_to_loop(
                    got[k], v, ref.state_dict()[k], what=f"member {i} {k}"
                )


def test_without_the_integration_lightning_couples_members():
    """The checks above can fail: a plain LightningModule's clip (one norm over all members)
    moves member 0 when member 3 explodes."""

    class Plain(pl.LightningModule):
        def __init__(self, scale):
            super().__init__()
            self.stack = phalanx.stack(make, num_members=N, seed=0, backend="loop")
            self.scale = torch.tensor(scale)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (phalanx.member_losses(F.cross_entropy, self.stack(x), y) * self.scale).sum()

        def configure_optimizers(self):
            return phalanx.optim.Adam(self.stack.parameters(), lr=LRS)

    dl = DataLoader(data(), batch_size=16)
    w = []
    for scale in (SCALE, [1.0] * N):
        plain = Plain(scale)
        trainer(max_steps=2, gradient_clip_val=1.0).fit(plain, dl)
        w.append(plain.stack.module[0].weight[0].detach())
    assert not torch.equal(*w)


class Scored(Ensemble):
    """Logs a synthetic validation score: member 1 gets worse every epoch, the others better."""

    def __init__(self, worse=(1,)):
        super().__init__(scale=[1.0] * N)
        self.worse = list(worse)
        self.snapshots = []

    def validation_step(self, batch, batch_idx):
        e = float(self.current_epoch)
        score = torch.tensor([e if i in self.worse else -e for i in range(N)])
        self.log_members("val_score", score)

    def on_train_epoch_start(self):
        self.snapshots.append({k: v.clone() for k, v in self.stack.state_dict().items()})

    def configure_optimizers(self):
        # the masked run against the free one bit for bit: mode="torch"'s promise (the
        # default's, float rounding, lets a mask move the others off torch's fused kernel)
        return phalanx.optim.Adam(self.stack.parameters(), lr=list(self.hparams.lrs), mode="torch")


def test_member_early_stopping_masks_the_member_and_leaves_the_others_bit_for_bit(tmp_path):
    dl = DataLoader(data(), batch_size=32)
    stopper = MemberEarlyStopping("val_score", patience=2)
    model = Scored()
    t = trainer(max_epochs=5, callbacks=[stopper], num_sanity_val_steps=0)
    t.fit(model, dl, dl)
    # member 1's score never improves after epoch 0: waits 1, 2 -> stopped at epoch 2
    assert model.member_mask.tolist() == [True, False, True, True]
    assert stopper.stopped_epoch.tolist() == [-1, 2, -1, -1]
    frozen = model.snapshots[3]  # weights at the start of epoch 3, the first masked epoch
    for k, v in model.stack.state_dict().items():
        assert torch.equal(v[1], frozen[k][1]), f"stopped member 1 moved: {k}"
    free = Scored()
    trainer(max_epochs=5, num_sanity_val_steps=0).fit(free, dl, dl)
    for k, v in free.stack.state_dict().items():
        for i in (0, 2, 3):
            assert torch.equal(model.stack.state_dict()[k][i], v[i]), f"member {i} {k}"
        assert not torch.equal(model.stack.state_dict()[k][1], v[1])
    # the checkpoint keeps the mask, the callback's counters and the optimizer state
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(path)
    back = Scored.load_from_checkpoint(path)
    assert back.member_mask.tolist() == [True, False, True, True]
    for k, v in model.stack.state_dict().items():
        assert torch.equal(back.stack.state_dict()[k], v)
    saved = torch.load(path, weights_only=False)
    assert saved["callbacks"][stopper.state_key]["stopped_epoch"].tolist() == [-1, 2, -1, -1]
    assert len(saved["optimizer_states"][0]["state"]) == 4


def test_the_trainer_stops_when_every_member_has():
    dl = DataLoader(data(), batch_size=32)
    model = Scored(worse=range(N))
    t = trainer(
        max_epochs=10,
        callbacks=[MemberEarlyStopping("val_score", patience=1)],
        num_sanity_val_steps=0,
    )
    t.fit(model, dl, dl)
    assert not model.member_mask.any()
    assert t.current_epoch == 2  # stopped after epoch 1's check


def test_member_checkpoint_writes_each_members_best_loadable_alone(tmp_path):
    dl = DataLoader(data(), batch_size=32)
    ckpt = MemberCheckpoint(tmp_path / "members", "val_score", mode="min")
    model = Scored()
    trainer(max_epochs=3, callbacks=[ckpt], num_sanity_val_steps=0).fit(model, dl, dl)
    summary = json.loads((tmp_path / "members" / "members.json").read_text())
    assert [row["epoch"] for row in summary] == [2, 0, 2, 2]  # member 1 was best at epoch 0
    net = make()
    net.load_state_dict(load_file(ckpt.path(2)))
    x = data(8).tensors[0]
    assert torch.equal(net(x), model.stack(x)[2])  # member 2's best is the last epoch
    first = load_file(ckpt.path(1))
    for k, v in first.items():  # member 1's file holds its weights after epoch 0
        assert torch.equal(v, model.snapshots[1]["module." + k][1])


def test_missing_member_metrics_are_named():
    model = Scored()
    t = trainer(max_epochs=1, callbacks=[MemberEarlyStopping("val_loss")], num_sanity_val_steps=0)
    dl = DataLoader(data(), batch_size=32)
    with pytest.raises(KeyError, match=r"val_loss/member_0.*self.log_members\('val_loss'"):
        t.fit(model, dl, dl)


def test_refuses_a_shared_grad_scaler():
    from pytorch_lightning.plugins.precision import MixedPrecision

    # on the CPU, precision="16-mixed" becomes bf16-mixed; the plugin keeps fp16 and its scaler
    t = trainer(max_steps=1, plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*GradScaler.*bf16-mixed"):
        t.fit(Ensemble(), DataLoader(data(), batch_size=16))


def test_bf16_mixed_runs_members_apart():
    exploding = Ensemble(scale=SCALE)
    calm = Ensemble(scale=[1.0] * N)
    for m in (exploding, calm):
        trainer(max_steps=3, precision="bf16-mixed", gradient_clip_val=1.0).fit(
            m, DataLoader(data(), batch_size=16)
        )
    assert torch.equal(exploding.stack.module[0].weight[:3], calm.stack.module[0].weight[:3])


def test_refuses_joint_clipping_of_a_plain_lightning_module():
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.stack = phalanx.stack(make, num_members=N, seed=0)

    t = trainer(max_steps=1, gradient_clip_val=1.0)
    with pytest.raises(TypeError, match=r"gradient_clip_val=1.0.*one norm.*StackModule"):
        check_trainer(t, Plain())
    with pytest.raises(TypeError, match="holds no phalanx stack"):
        check_trainer(t, pl.LightningModule())


def test_refuses_early_stopping_without_a_member_optimizer_or_with_manual_optimization():
    class TorchOpt(Ensemble):
        def configure_optimizers(self):
            return torch.optim.SGD(self.stack.parameters(), lr=0.1)

    class Manual(Ensemble):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    dl = DataLoader(data(), batch_size=16)
    cb = [MemberEarlyStopping("val_loss")]
    with pytest.raises(TypeError, match=r"returned SGD.*phalanx optimizer"):
        trainer(max_steps=1, callbacks=cb).fit(TorchOpt(), dl)
    with pytest.raises(ValueError, match=r"manual optimization.*mask=self.member_mask"):
        trainer(max_steps=1, callbacks=cb).fit(Manual(), dl)
    plain = pl.LightningModule()
    plain.stack = phalanx.stack(make, num_members=N)
    with pytest.raises(TypeError, match=r"not a phalanx.integrations.lightning.StackModule"):
        cb[0].setup(trainer(max_steps=1), plain, "fit")


def test_refuses_sharding_strategies(monkeypatch):
    from pytorch_lightning.strategies import FSDPStrategy

    t = trainer(max_steps=1)
    monkeypatch.setattr(
        type(t), "strategy", property(lambda self: FSDPStrategy.__new__(FSDPStrategy))
    )
    with pytest.raises(ValueError, match=r"FSDPStrategy shards.*strategy='ddp'"):
        check_trainer(t, Ensemble())


def test_log_members_refuses_a_summed_loss():
    with pytest.raises(ValueError, match=r"shape \(4,\); got shape \(\)"):
        Ensemble().log_members("loss", torch.tensor(1.0))


def test_member_early_stopping_on_train_epoch_end():
    """check_on_train_epoch_end=True reads a training metric; no validation loop needed."""

    class TrainScored(Scored):
        def training_step(self, batch, batch_idx):
            e = float(self.current_epoch)
            self.log_members("score", torch.tensor([e if i == 2 else -e for i in range(N)]))
            return super().training_step(batch, batch_idx)

    stopper = MemberEarlyStopping("score", patience=1, check_on_train_epoch_end=True)
    model = TrainScored()
    trainer(max_epochs=3, callbacks=[stopper]).fit(model, DataLoader(data(), batch_size=32))
    assert model.member_mask.tolist() == [True, True, False, True]
    assert stopper.stopped_epoch.tolist() == [-1, -1, 1, -1]


class Stepped(StackModule):
    """phalanx runs the step (``step=``): manual optimization through ``member_step``; member
    ``nan`` diverged (NaN weights) before training."""

    def __init__(self, step="captured", nan=None, dtype=torch.float32, backend="aot_eager"):
        super().__init__(step=step)
        self.stack = phalanx.stack(make, num_members=N, seed=0, backend="loop").to(dtype)
        self.dtype_, self.compiler = dtype, backend
        if nan is not None:
            with torch.no_grad():
                self.stack.module[0].weight[nan, 0, 0] = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = self.member_step(
            F.cross_entropy, x.to(self.dtype_), y, max_norm=1.0, backend=self.compiler
        )
        self.log_members("train_loss", losses)

    def validation_step(self, batch, batch_idx):
        e = float(self.current_epoch)
        self.log_members("val_score", torch.tensor([e if i == 1 else -e for i in range(N)]))

    def configure_optimizers(self):
        return phalanx.optim.Adam(self.stack.parameters(), lr=LRS)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_the_captured_step_gives_lightnings_members_with_one_diverging(compiler):
    """Member 2 NaN from the start: members 0, 1 and 3 end where Lightning's own loop
    (automatic optimization, gradient_clip_val=1.0) takes them, to float rounding against its
    float64 run; 8 steps, captured from the 4th."""
    dl = DataLoader(data(), batch_size=16)
    refs = []
    for dtype in (torch.float32, torch.float64):
        ref = Ensemble(scale=[1.0] * N).to(dtype)
        with torch.no_grad():
            ref.stack.module[0].weight[2, 0, 0] = float("nan")
        dl_ = DataLoader(TensorDataset(*(t.to(dtype) if t.is_floating_point() else t
                                         for t in data().tensors)), batch_size=16)  # fmt: skip
        trainer(max_steps=8, gradient_clip_val=1.0).fit(ref, dl_)
        refs.append(ref)
    model = Stepped(nan=2, backend=compiler)
    t = trainer(max_steps=8)
    t.fit(model, dl)
    assert model.step_choice == "captured" and t.global_step == 8
    assert model.last_grad_norms[2].isnan() and model.last_grad_norms[[0, 1, 3]].isfinite().all()
    for i in (0, 1, 3):
        got = phalanx.export_members(model.stack, [i])[0]
        ref, ref64 = (phalanx.export_members(r.stack, [i])[0] for r in refs)
        for k, v in got.items():
            phalanx.testing.assert_equal_to_loop(v, ref[k], ref64[k], what=f"member {i} {k}")


def test_the_captured_step_masks_stopped_members_and_resumes_from_a_checkpoint(tmp_path):
    dl = DataLoader(data(), batch_size=16)

    def fit(epochs, ckpt=None, save=None):
        model = Stepped()
        stopper = MemberEarlyStopping("val_score", patience=1)
        t = trainer(max_epochs=epochs, callbacks=[stopper], num_sanity_val_steps=0)
        t.fit(model, dl, dl, ckpt_path=ckpt)
        if save:
            t.save_checkpoint(save)
        return model, t

    whole, t = fit(4)
    assert whole.member_mask.tolist() == [True, False, True, True]  # stopped at epoch 1
    assert t.global_step == 4 * 6 and whole.step_choice == "captured"
    half, _ = fit(2, save=tmp_path / "half.ckpt")
    resumed, t = fit(4, ckpt=tmp_path / "half.ckpt")
    assert resumed.member_mask.tolist() == [True, False, True, True] and t.global_step == 24
    for k, v in whole.stack.state_dict().items():
        torch.testing.assert_close(resumed.stack.state_dict()[k], v)
        assert torch.equal(v[1], half.stack.state_dict()[k][1])  # member 1: stopped, not moved


def test_the_step_option_is_checked_and_member_step_needs_it():
    with pytest.raises(ValueError, match=r"step must be 'auto'.*got 'fast'"):
        Stepped(step="fast")

    class Automatic(Ensemble):
        def training_step(self, batch, batch_idx):
            return self.member_step(F.cross_entropy, *batch)

    with pytest.raises(ValueError, match=r"built without step=.*step='auto'"):
        trainer(max_steps=1).fit(Automatic(), DataLoader(data(), batch_size=16))
    model = Stepped(step="eager")
    assert not model.automatic_optimization
    trainer(max_steps=2).fit(model, DataLoader(data(), batch_size=16))
    assert model.step_choice == "eager"
