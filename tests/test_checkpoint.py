"""phalanx.save / load: safetensors only, atomic, bit-identical resume, clear mismatches."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import phalanx
from helpers import ARCHS, make_members
from phalanx.checkpoint._single import CheckpointError

N = 6


def build(seed: int, n: int = N, hidden: int = 20):
    """A stack, Adam with per-member lrs and isolation, a StepLR and a bootstrap loader."""
    torch.manual_seed(seed)
    members = [
        nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 2)) for _ in range(n)
    ]
    # A fixed backend: under "auto" the original and the resumed stack may each race to a
    # different backend, whose results agree to float rounding but not bit for bit.
    stack = phalanx.stack(members, backend="vmap")
    opt = phalanx.optim.Adam(stack.parameters(), lr=torch.logspace(-3, -1, n), skip_nonfinite=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(40, 10, generator=g), torch.randint(0, 2, (40,), generator=g)
    loader = phalanx.data.MemberLoader(X, Y, num_members=n, batch_size=8, bootstrap=True, seed=seed)
    return stack, opt, sched, loader


def train(stack, opt, sched, loader, steps: int) -> list[list[torch.Tensor]]:
    history = []
    batches = (b for _ in range(100) for b in loader)
    for _ in range(steps):
        xb, yb = next(batches)  # (N, B, 10), (N, B)
        losses = phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()
        opt.step(mask=torch.arange(len(stack)) != 1)  # member 1 is paused: its own step count
        sched.step()
        history.append([p.detach().clone() for p in stack.parameters()])
    return history


def test_resume_gives_bit_identical_next_steps(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=7)  # mid-epoch: 5 batches per epoch
    phalanx.save(
        path, stack, optimizer=opt, scheduler=sched, loader=loader, epoch=1, best=torch.arange(3)
    )
    expected = train(stack, opt, sched, loader, steps=6)

    stack2, opt2, sched2, loader2 = build(seed=1)  # other weights, other data seed
    extra = phalanx.load(path, stack2, optimizer=opt2, scheduler=sched2, loader=loader2)
    assert extra["epoch"] == 1 and torch.equal(extra["best"], torch.arange(3))
    got = train(stack2, opt2, sched2, loader2, steps=6)
    for t, (a, b) in enumerate(zip(expected, got, strict=True)):
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q), f"step {t} after resuming differs"
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_the_file_is_plain_safetensors_with_json_metadata(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=2)
    phalanx.save(path, stack, optimizer=opt, scheduler=sched, loader=loader, note="lr sweep")
    with safetensors.safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["phalanx"])
    assert "stack/module.0.weight" in keys
    assert "optimizer.state.0.exp_avg" in keys and "optimizer.members.frozen" in keys
    assert meta["num_members"] == N and meta["extra"] == {"note": "lr sweep"}
    assert meta["loader"]["batch"] == 2 and meta["scheduler"]["last_epoch"] == 2
    # no temporary left; the lock savers take turns on stays (deleting it would race)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".run.safetensors.lock",
        "run.safetensors",
    ]


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    phalanx.save(path, stack, optimizer=opt)
    good = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with torch.no_grad():
        next(iter(stack.parameters())).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        phalanx.save(path, stack, optimizer=opt)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == [".run.safetensors.lock", "run.safetensors"]


def test_loading_into_another_n_names_keys_expected_and_got(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    phalanx.save(path, stack, optimizer=opt)
    other, other_opt, *_ = build(seed=0, n=4)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(
        ValueError,
        match=r"phalanx.load\(\): checkpoint '.*run.safetensors' does not fit this stack: key "
        r"'module.0.weight' expected shape \(4, 20, 10\) \(this stack\), got \(6, 20, 10\) "
        r"\(checkpoint\);.* The checkpoint holds 6 members, this stack 4",
    ):
        phalanx.load(path, other, optimizer=other_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


def test_loading_into_another_architecture_fails_clearly(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, *_ = build(seed=0)
    phalanx.save(path, stack)
    wider, *_ = build(seed=0, hidden=30)
    with pytest.raises(
        ValueError,
        match=r"key 'module.2.weight' expected shape \(6, 2, 30\) \(this stack\), got \(6, 2, 20\)",
    ):
        phalanx.load(path, wider)
    deeper = phalanx.stack(
        [
            nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2), nn.Linear(2, 2))
            for _ in range(N)
        ]
    )
    with pytest.raises(ValueError, match=r"key 'module.3.weight' is missing from the checkpoint"):
        phalanx.load(path, deeper)


def test_optimizer_mismatch_and_missing_parts_are_named(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=1)
    phalanx.save(path, stack, optimizer=opt)
    params = list(stack.parameters())
    split = phalanx.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(
        ValueError,
        match=r"the optimizer state in .* does not fit this optimizer: 1 param groups saved, 2 in the optimizer",
    ):
        phalanx.load(path, stack, optimizer=split)
    with pytest.raises(
        ValueError, match=r"holds no loader state; save it with phalanx.save\(..., loader=loader\)"
    ):
        phalanx.load(path, stack, loader=loader)
    plain = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(1)}, str(plain))
    with pytest.raises(ValueError, match=r"is not a phalanx checkpoint"):
        phalanx.load(plain, stack)
    with pytest.raises(
        TypeError,
        match=r"phalanx.save\(\): 'extra.fn' is a function, which a checkpoint cannot hold without pickle",
    ):
        phalanx.save(path, stack, fn=lambda: 0)


def test_member_lambda_lr_state_round_trips(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    sched = phalanx.optim.MemberLambdaLR(opt, lambda e: torch.linspace(1, 2, N) ** e)
    sched.step()
    phalanx.save(path, stack, optimizer=opt, scheduler=sched)
    stack2, opt2, *_ = build(seed=1)
    sched2 = phalanx.optim.MemberLambdaLR(opt2, lambda e: torch.linspace(1, 2, N) ** e)
    phalanx.load(path, stack2, optimizer=opt2, scheduler=sched2)
    sched.step()
    sched2.step()
    assert torch.equal(opt.param_groups[0]["member_lr"], opt2.param_groups[0]["member_lr"])


def test_export_members_gives_ordinary_state_dicts() -> None:
    members = make_members(ARCHS[1], N)
    stack = phalanx.stack(members)
    x = torch.randn(5, 10)
    out = stack(x)
    best = torch.tensor([4, 0, 2])
    states = phalanx.export_members(stack, best)
    assert len(states) == 3 and set(states[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for k, state in zip(best.tolist(), states, strict=True):
        model = ARCHS[1].make()
        model.load_state_dict(state)
        torch.testing.assert_close(model(x), out[k], rtol=1e-5, atol=1e-6)
    states[0]["0.weight"].zero_()  # copies: the stack is untouched
    assert not bool((stack.state_dict()["module.0.weight"][4] == 0).all())
    mask = torch.tensor([True, False, False, False, False, True])
    assert [s["0.bias"].tolist() for s in phalanx.export_members(stack, mask)] == [
        members[0][0].bias.tolist(),
        members[5][0].bias.tolist(),
    ]
    with pytest.raises(
        IndexError,
        match=r"export_members\(\): member indices \[6\] are out of range for a stack of 6 members",
    ):
        phalanx.export_members(stack, [6])


# ------------------------------------------------------ all or nothing; hostile and corrupt files


def _snapshot(stack, opt, sched, loader) -> list:
    import copy

    return [
        {k: v.clone() for k, v in stack.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(sched.state_dict()),
        dict(loader.state_dict()),
    ]


def _same(a, b) -> bool:
    from torch.utils import _pytree as pytree

    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def test_a_load_that_fails_late_changes_nothing(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=3)
    phalanx.save(path, stack, optimizer=opt, scheduler=sched, loader=loader)
    stack2, opt2, sched2, _ = build(seed=1)
    train(stack2, opt2, sched2, _, steps=1)
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(40, 10, generator=g), torch.randint(0, 2, (40,), generator=g)
    other_batch = phalanx.data.MemberLoader(X, Y, num_members=N, batch_size=4, bootstrap=True)
    before = _snapshot(stack2, opt2, sched2, other_batch)
    with pytest.raises(
        CheckpointError,
        match=r"phalanx.load\(\): the loader state in '.*run.safetensors' does not fit this "
        r"loader: .*batch_size is 4 in this loader but 8 in the saved state",
    ):
        phalanx.load(path, stack2, optimizer=opt2, scheduler=sched2, loader=other_batch)
    after = _snapshot(stack2, opt2, sched2, other_batch)
    assert all(_same(a, b) for a, b in zip(before, after, strict=True))


def test_an_optimizer_checkpoint_loads_only_into_the_same_optimizer_type(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    phalanx.save(path, stack, optimizer=opt)
    for other, name in [
        (phalanx.optim.SGD(stack.parameters()), "phalanx.optim.SGD"),
        (torch.optim.Adam(stack.parameters()), "torch.optim.Adam"),
    ]:
        lr = other.param_groups[0]["lr"]
        with pytest.raises(
            CheckpointError,
            match=rf"'.*run.safetensors' holds the state of a phalanx.optim.Adam optimizer, "
            rf"but a {name} was given",
        ):
            phalanx.load(path, stack, optimizer=other)
        assert other.param_groups[0]["lr"] == lr and not other.state


class _Raw(str):
    """Metadata text to write as it is, instead of the edited JSON."""


def _rewrite(path, edit) -> None:
    """Edits a saved checkpoint's metadata and tensors in place, as a hostile writer could."""
    tensors = safetensors.torch.load_file(str(path))
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["phalanx"])
    raw = edit(meta, tensors)
    text = raw if isinstance(raw, _Raw) else json.dumps(meta)
    safetensors.torch.save_file(tensors, str(path), metadata={"phalanx": text})


def _group(meta, key, value):
    meta["optimizer"]["param_groups"][0][key] = value


def _retype(tensors, key, dtype):
    tensors[key] = tensors[key].to(dtype)


HOSTILE_VALUES = {
    "lr as a string": (
        lambda m, t: _group(m, "lr", "0.1"),
        r"param group 0 hyperparameter 'lr' is '0.1', expected a number",
    ),
    "betas (2, -5)": (
        lambda m, t: _group(m, "betas", {"__tuple__": [2, -5]}),
        r"param group 0 hyperparameters are refused by phalanx.optim.Adam\(\): .*betas\[0\] is "
        r"2.0 for every member; expected in \[0, 1\)",
    ),
    "eps negative": (
        lambda m, t: _group(m, "eps", -1.0),
        r"refused by phalanx.optim.Adam\(\): .*eps is -1.0 for every member; expected >= 0",
    ),
    "int64 weights": (
        lambda m, t: _retype(t, "stack/module.0.weight", torch.int64),
        r"key 'module.0.weight' expected dtype torch.float32 \(this stack\), got torch.int64",
    ),
    "int64 moments": (
        lambda m, t: _retype(t, "optimizer.state.0.exp_avg", torch.int64),
        r"key 'optimizer.state.0.exp_avg' expected dtype torch.float32, got torch.int64",
    ),
    "int64 step": (
        lambda m, t: _retype(t, "optimizer.state.0.step", torch.int64),
        r"key 'optimizer.state.0.step' has dtype torch.int64, expected a float dtype",
    ),
    "float frozen flags": (
        lambda m, t: _retype(t, "optimizer.members.frozen", torch.float32),
        r"state\['members'\]\['frozen'\] is a torch.float32 tensor of shape \(6,\), expected "
        r"torch.bool \(6,\)",
    ),
    "scheduler epoch as a string": (
        lambda m, t: m["scheduler"].update(last_epoch="3"),
        r"the scheduler state in .* does not fit this scheduler: the scheduler "
        r"state\['last_epoch'\] is '3', expected a number",
    ),
    "another scheduler type": (
        lambda m, t: m["types"].update(scheduler="torch.optim.lr_scheduler.ExponentialLR"),
        r"holds the state of a torch.optim.lr_scheduler.ExponentialLR scheduler, but a "
        r"torch.optim.lr_scheduler.StepLR was given",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_VALUES))
def test_values_read_from_a_checkpoint_are_validated_like_the_constructors_do(
    tmp_path, case
) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=1)
    phalanx.save(path, stack, optimizer=opt, scheduler=sched, loader=loader)
    edit, message = HOSTILE_VALUES[case]
    _rewrite(path, edit)
    before = _snapshot(stack, opt, sched, loader)
    with pytest.raises(CheckpointError, match=message):
        phalanx.load(path, stack, optimizer=opt, scheduler=sched, loader=loader)
    assert all(_same(a, b) for a, b in zip(before, _snapshot(stack, opt, sched, loader)))


CORRUPT = {
    "bad JSON": (lambda m, t: _Raw("{not json"), r"its metadata is not valid JSON"),
    "100,000 brackets": (lambda m, t: _Raw("[" * 100_000 + "]" * 100_000), r"nests too deeply"),
    "deep but parsable": (
        lambda m, t: m["extra"].update(deep=json.loads("[" * 200 + "]" * 200)),
        r"extra.deep\[0\]\[0\].* nests more than 64 levels deep",
    ),
    "a JSON list": (
        lambda m, t: _Raw("[1, 2]"),
        r"its metadata is a JSON list, expected an object",
    ),
    "no format": (lambda m, t: m.pop("format"), r"is not a phalanx checkpoint: format None"),
    "optimizer is a list": (
        lambda m, t: m.update(optimizer=[]),
        r"its optimizer entry is a list, expected an object",
    ),
    "optimizer without param_groups": (
        lambda m, t: m["optimizer"].pop("param_groups"),
        r"its optimizer state lacks 'state' \(a mapping\) or 'param_groups'",
    ),
    "a tensor that is not there": (
        lambda m, t: m["optimizer"]["state"]["__items__"][0][1].update(
            exp_avg={"__tensor__": "nope"}
        ),
        r"optimizer.*exp_avg.* names a tensor 'nope' that the file does not hold",
    ),
    "num_members a string": (lambda m, t: m.update(num_members="6"), r"num_members is '6'"),
    "a bad float": (
        lambda m, t: m["extra"].update(x={"__float__": "1e999999"}),
        r"extra.x holds a non-finite float written as '1e999999'",
    ),
    "a malformed mapping": (
        lambda m, t: m["extra"].update(x={"__items__": [[1]]}),
        r"extra.x holds a mapping that is not a list of \[key, value\] pairs",
    ),
    "a missing stack key": (
        lambda m, t: t.pop("stack/module.0.bias"),
        r"key 'module.0.bias' is missing from the checkpoint",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_metadata_gives_one_error_naming_the_file(tmp_path, case) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=1)
    phalanx.save(path, stack, optimizer=opt, scheduler=sched, loader=loader, note=1)
    edit, message = CORRUPT[case]
    _rewrite(path, edit)
    before = _snapshot(stack, opt, sched, loader)
    with pytest.raises(
        CheckpointError, match=r"phalanx.load\(\): .*'.*run.safetensors'.*" + message
    ):
        phalanx.load(path, stack, optimizer=opt, scheduler=sched, loader=loader)
    assert all(_same(a, b) for a, b in zip(before, _snapshot(stack, opt, sched, loader)))


def test_truncated_empty_and_foreign_files_give_one_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    phalanx.save(path, stack, optimizer=opt)
    data = path.read_bytes()
    for name, content in [("truncated", data[:-100]), ("empty", b""), ("noise", b"\x00" * 64)]:
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(
            CheckpointError,
            match=rf"'.*{name}.safetensors' is not a readable safetensors file; it may be truncated",
        ):
            phalanx.load(bad, stack, optimizer=opt)
    with pytest.raises(FileNotFoundError, match=r"'.*nothing.safetensors' does not exist"):
        phalanx.load(tmp_path / "nothing.safetensors", stack)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(0, 10_000), flips=st.lists(st.integers(0, 10_000), max_size=3))
def test_any_damage_loads_or_raises_checkpoint_error_never_anything_else(
    tmp_path, cut, flips
) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0, n=2, hidden=3)
    phalanx.save(path, stack, optimizer=opt, scheduler=sched, loader=loader)
    data = bytearray(path.read_bytes())
    for k in flips:
        data[k % len(data)] ^= 0xA5
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data[: len(data) - cut % len(data)] if cut % 2 else data))
    with contextlib.suppress(CheckpointError):  # anything else fails the test
        phalanx.load(bad, stack, optimizer=opt, scheduler=sched, loader=loader)


def test_extra_keys_that_collide_when_flattened_each_read_back_their_own(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, *_ = build(seed=0)
    dotted, nested = torch.tensor([1.0]), torch.tensor([2.0])
    phalanx.save(path, stack, **{"val.loss": dotted}, val={"loss": nested})
    extra = phalanx.load(path, build(seed=1)[0])
    assert torch.equal(extra["val.loss"], dotted) and torch.equal(extra["val"]["loss"], nested)


def test_a_checkpoint_that_does_not_fit_is_refused_from_its_header(tmp_path, monkeypatch) -> None:
    """No tensor data is read before the stack's keys, shapes and dtypes are checked."""
    from phalanx.checkpoint import _files

    path = tmp_path / "big.safetensors"
    phalanx.save(path, build(seed=0, hidden=64)[0])
    copied = []
    real = _files._tensor
    monkeypatch.setattr(
        _files, "_tensor", lambda *a, **k: copied.append(k.get("data", True)) or real(*a, **k)
    )
    with pytest.raises(phalanx.CheckpointError, match=r"does not fit this stack: key .* shape"):
        phalanx.load(path, build(seed=0, hidden=20)[0])
    assert copied and not any(copied)  # only shapes were looked at


def test_damaged_files_are_one_clear_error(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack = build(seed=0)[0]
    phalanx.save(path, stack)
    good = path.read_bytes()
    header = int.from_bytes(good[:8], "little")
    for name, data in {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "header length past the end": (10**12).to_bytes(8, "little") + good[8:],
        "header not JSON": good[:8] + b"\xff" * header + good[8 + header :],
    }.items():
        path.write_bytes(data)
        with pytest.raises(phalanx.CheckpointError, match=r"not a readable safetensors file"):
            phalanx.load(path, stack)
        assert name
