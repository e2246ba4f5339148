"""Widths in one stack (``phalanx.stack(models, pad_widths=True)``): each member against itself
run alone (float32, and float64 as the reference), outputs, input and parameter gradients,
optimizer steps; padded entries exactly 0; unstack, copy_to, checkpoints; the refusals."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.testing import assert_equal_to_loop

BACKENDS = ["fused", "vmap", "loop"]


def mlp(width: int, width2: int, act: type[nn.Module] = nn.Sigmoid) -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, width), act(), nn.Linear(width, width2), nn.ReLU(), nn.Linear(width2, 3)
    )


def cnn(channels: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3),
        nn.BatchNorm2d(channels),
        nn.GELU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(channels * 9, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 3),
    )


class Residual(nn.Module):
    """A custom forward: fx traces it; the residual adds two tensors padded alike."""

    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.block = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.inp(x))
        h = h + torch.sigmoid(self.block(h))
        return self.out(h)


def members(kind: str) -> tuple[list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    if kind == "mlp":
        models = [mlp(w, v) for w, v in [(4, 5), (9, 3), (6, 6), (2, 7)]]
        return models, torch.randn(4, 5, 6)
    if kind == "cnn":
        models = [cnn(c, h) for c, h in [(2, 5), (4, 3), (3, 8)]]
        return models, torch.randn(3, 5, 1, 8, 8)
    if kind == "batchnorm":  # BatchNorm of zero-padded units, in training mode
        models = [
            nn.Sequential(nn.Linear(6, w), nn.BatchNorm1d(w), nn.Sigmoid(), nn.Linear(w, 3))
            for w in (5, 2, 7)
        ]
        return models, torch.randn(3, 5, 6)
    models = [Residual(w) for w in (3, 8, 5)]
    return models, torch.randn(3, 5, 6)


def own_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "residual", "batchnorm"])
def test_outputs_and_gradients_equal_each_member_alone(kind: str, backend: str) -> None:
    models, xs = members(kind)
    stack = phalanx.stack(models, pad_widths=True, backend=backend)
    x = xs.clone().requires_grad_(True)
    out = stack(x, in_dims=0)
    out.pow(2).sum().backward()

    alone, wide = [copy.deepcopy(m) for m in models], [copy.deepcopy(m).double() for m in models]
    x32 = [xs[i].clone().requires_grad_(True) for i in range(len(models))]
    x64 = [xs[i].double().requires_grad_(True) for i in range(len(models))]
    loop = torch.stack([m(v) for m, v in zip(alone, x32)])
    reference = torch.stack([m(v) for m, v in zip(wide, x64)])
    for i in range(len(models)):
        loop[i].pow(2).sum().backward(retain_graph=True)
        reference[i].pow(2).sum().backward(retain_graph=True)
    assert_equal_to_loop(out, loop, reference, what="outputs", per_member=True)
    assert_equal_to_loop(
        x.grad,
        torch.stack([v.grad for v in x32]),
        torch.stack([v.grad for v in x64]),
        what="input gradients",
        per_member=True,
    )
    padding = stack.padding
    assert padding is not None
    for name, p in stack.module.named_parameters():
        assert p.grad is not None
        for i in range(len(models)):
            corner = padding.corner(name, i)
            # A conv bias before BatchNorm has a gradient that cancels to 0 from terms the
            # size of the member's other gradients: their rounding is the floor.
            terms = max(g.abs().max().item() for g in own_grads(wide[i]).values())
            assert_equal_to_loop(
                p.grad[i][corner],
                own_grads(alone[i])[name],
                own_grads(wide[i])[name],
                what=f"member {i} '{name}' gradient",
                floor_scale=terms,
            )
        mask = padding.mask(name, p)
        assert torch.equal(p.grad[~mask], torch.zeros_like(p.grad[~mask])), name
    for name, b in stack.module.named_buffers():  # running statistics, as each member's
        for i in range(len(models)):
            own = alone[i].get_buffer(name)
            if own.is_floating_point():
                assert_equal_to_loop(
                    b[i][padding.corner(name, i)], own, wide[i].get_buffer(name), what=name
                )
            else:
                assert torch.equal(b[i][padding.corner(name, i)], own), name


def test_embedding_widths() -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Embedding(20, w), nn.GELU(), nn.Linear(w, 3)) for w in (4, 9, 6)]
    stack = phalanx.stack(models, pad_widths=True)
    tokens = torch.randint(0, 20, (5, 7))
    loop = torch.stack([m(tokens) for m in models])
    reference = torch.stack([copy.deepcopy(m).double()(tokens) for m in models])
    assert_equal_to_loop(stack(tokens), loop, reference, what="outputs", per_member=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps, lr, wd: phalanx.optim.Adam(ps, lr=lr, weight_decay=wd),
        lambda ps, lr, wd: phalanx.optim.AdamW(ps, lr=lr, weight_decay=wd, amsgrad=True),
        lambda ps, lr, wd: phalanx.optim.SGD(
            ps, lr=lr, momentum=0.9, weight_decay=wd, nesterov=True
        ),
    ],
    ids=["Adam", "AdamW-amsgrad", "SGD-nesterov"],
)
@pytest.mark.parametrize("backend", ["fused", "loop"])
def test_optimizer_steps_equal_each_member_alone_and_padding_stays_zero(make, backend) -> None:
    models, xs = members("mlp")
    n = len(models)
    y = torch.randint(0, 3, (n, 5))
    lrs, wds = torch.tensor([1e-3, 3e-2, 1e-2, 1e-1]), torch.tensor([0.0, 0.1, 0.01, 0.5])
    stack = phalanx.stack(models, pad_widths=True, backend=backend)
    opt = make(stack.parameters(), lrs, wds)
    # Each member alone: a stack of one on the loop backend is the member's own module run
    # with phalanx's optimizer at its own hyperparameters (phalanx.optim's rule is tested bit
    # for bit against torch.optim in test_optim.py).
    singles = [phalanx.stack([m], backend="loop") for m in models]
    alone_opts = [
        make(s.parameters(), lrs[i : i + 1], wds[i : i + 1]) for i, s in enumerate(singles)
    ]
    wide = [phalanx.stack([copy.deepcopy(m).double()], backend="loop") for m in models]
    wide_opts = [
        make(s.parameters(), lrs[i : i + 1].double(), wds[i : i + 1].double())
        for i, s in enumerate(wide)
    ]
    for _ in range(6):
        opt.zero_grad()
        phalanx.member_losses(
            F.cross_entropy, stack(xs, in_dims=0), y, in_dims=(0, 0)
        ).sum().backward()
        opt.step()
        for i, (s, o, w, wo) in enumerate(zip(singles, alone_opts, wide, wide_opts)):
            o.zero_grad()
            F.cross_entropy(s(xs[i : i + 1], in_dims=0)[0], y[i]).backward()
            o.step()
            wo.zero_grad()
            F.cross_entropy(w(xs[i : i + 1].double(), in_dims=0)[0], y[i]).backward()
            wo.step()
    padding = stack.padding
    assert padding is not None
    for name, p in stack.module.named_parameters():
        mask = padding.mask(name, p)
        for i, (s, w) in enumerate(zip(singles, wide)):
            own, reference = s.module.get_parameter(name)[0], w.module.get_parameter(name)[0]
            assert_equal_to_loop(
                p[i][padding.corner(name, i)], own, reference, what=f"member {i} '{name}'"
            )
        assert torch.equal(p[~mask], torch.zeros_like(p[~mask])), f"padded '{name}' moved"
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                assert torch.equal(value[~mask], torch.zeros_like(value[~mask])), (name, key)


def test_unstack_copy_to_and_the_widths_error_without_the_keyword() -> None:
    models, xs = members("cnn")
    with pytest.raises(ValueError, match=r"pad_widths=True"):
        phalanx.stack(models)
    stack = phalanx.stack(models, pad_widths=True)
    with torch.no_grad():
        for p in stack.parameters():
            p.mul_(2)  # padded zeros stay zeros
    back = stack.unstack()
    for i, (m, b) in enumerate(zip(models, back)):
        assert [tuple(t.shape) for t in m.state_dict().values()] == [
            tuple(t.shape) for t in b.state_dict().values()
        ]
        assert b[0].out_channels == m[0].out_channels and b[5].in_features == m[5].in_features
        torch.testing.assert_close(b.eval()(xs[i]), stack.eval()(xs, in_dims=0)[i])
    targets = [copy.deepcopy(m) for m in models]
    stack.copy_to(targets)
    for t, b in zip(targets, back):
        for (k, u), v in zip(t.state_dict().items(), b.state_dict().values()):
            assert torch.equal(u, v), k
    wrong = list(reversed(targets))
    with pytest.raises(ValueError, match=r"the stack's member 0"):
        stack.copy_to(wrong)


def test_checkpoint_and_export_keep_each_members_shapes(tmp_path) -> None:
    models, xs = members("mlp")
    stack = phalanx.stack(models, pad_widths=True)
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    stack(xs, in_dims=0).sum().backward()
    opt.step()
    path = tmp_path / "run.safetensors"
    phalanx.save(path, stack, optimizer=opt)
    again = phalanx.stack(members("mlp")[0], pad_widths=True)
    opt2 = phalanx.optim.Adam(again.parameters(), lr=1e-2)
    phalanx.load(path, again, optimizer=opt2)
    assert torch.equal(again(xs, in_dims=0), stack(xs, in_dims=0))
    states = phalanx.export_members(stack, [1, 3])
    for i, state in zip([1, 3], states):
        fresh = copy.deepcopy(models[i])
        fresh.load_state_dict(state)
        torch.testing.assert_close(fresh(xs[i]), stack(xs, in_dims=0)[i])
    torch.manual_seed(0)
    other = [mlp(w, v) for w, v in [(4, 5), (9, 3), (6, 6), (9, 7)]]  # member 3 wider
    with pytest.raises(phalanx.CheckpointError, match=r"member 3: saved \(2, 6\), stack \(9, 6\)"):
        phalanx.load(path, phalanx.stack(other, pad_widths=True))
    with pytest.raises(phalanx.CheckpointError, match=r"padded to the widest but the stack"):
        phalanx.load(path, phalanx.stack([mlp(9, 7) for _ in range(4)]))


def test_keep_and_copy_members_carry_the_widths() -> None:
    models, xs = members("mlp")
    stack = phalanx.stack(models, pad_widths=True)
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    kept = phalanx.population.keep_members(stack, [3, 1], optimizer=opt)
    assert kept.padding is not None and kept.padding.shapes["0.weight"] == [(2, 6), (9, 6)]
    assert kept.unstack()[0][0].out_features == 2
    with torch.no_grad():  # the replaced stack still evaluates
        torch.testing.assert_close(kept(xs[[3, 1]], in_dims=0), stack(xs, in_dims=0)[[3, 1]])
    stack = phalanx.stack(models, pad_widths=True)
    phalanx.population.copy_members(stack, [3], [0])  # member 3 is 2 units wide, member 0 4
    assert stack.unstack()[0][0].out_features == 2
    out = stack(xs[[3, 1, 2, 3]], in_dims=0)
    assert torch.equal(out[0], out[3])
    stack(xs, in_dims=0).sum().backward()  # member 0's gradients now masked at member 3's widths
    mask = stack.padding.mask("0.weight", stack.module[0].weight)
    assert int(mask[0].sum()) == 2 * 6 and torch.equal(mask[0], mask[3])
    assert torch.equal(stack.module[0].weight.grad[0], stack.module[0].weight.grad[0] * mask[0])


def test_factory_and_zero_padding_() -> None:
    widths = [3, 7, 5]
    stack = phalanx.stack(lambda i: mlp(widths[i], 4), num_members=3, pad_widths=True, seed=1)
    torch.manual_seed(1 + 2)
    assert torch.equal(stack.unstack()[2][0].weight, mlp(5, 4)[0].weight)
    with torch.no_grad():
        stack.module[0].weight.add_(1.0)
    stack.zero_padding_()
    assert torch.equal(stack.module[0].weight[0, 3:], torch.zeros(4, 6))


def test_compile_step_masks_the_padded_gradients() -> None:
    models, xs = members("mlp")
    y = torch.randint(0, 3, (len(models), 5))
    stack = phalanx.stack(models, pad_widths=True, backend="vmap")
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    step = phalanx.compile_step(stack, F.cross_entropy, opt, in_dims=0)
    for _ in range(3):
        step(xs, y)
    for name, p in stack.module.named_parameters():
        mask = stack.padding.mask(name, p)
        assert torch.equal(p[~mask], torch.zeros_like(p[~mask])), name


class Mean(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(6, width), nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).mean(-1, keepdim=True))


class Skip(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(6, width), nn.Linear(width, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + x[..., :1])


class Branchy(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(6, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else -self.b(h)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda w: nn.Sequential(nn.Linear(6, w), nn.LayerNorm(w), nn.Linear(w, 3)),
            r"LayerNorm '1': a LayerNorm normalizes over the padded dimension",
        ),
        (
            lambda w: nn.Sequential(nn.Linear(6, w), nn.Softmax(-1), nn.Linear(w, 3)),
            r"Softmax '1': a softmax over the padded dimension",
        ),
        (
            lambda w: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, w)),
            r"the member's output .* differs in width among the members \(its widths are "
            r"member 0: 4, member 1: 8\)",
        ),
        (
            lambda w: nn.Sequential(nn.Linear(w, 8), nn.ReLU(), nn.Linear(8, 3)),
            r"Linear '0': its in_features differ among the members but its input is not padded",
        ),
        (lambda w: Mean(w), r"call_method 'mean' \(mean\): phalanx cannot check"),
        (lambda w: Skip(w), r"combines a padded tensor with one padded otherwise"),
        (
            lambda w: nn.Sequential(
                nn.Linear(6, w), nn.Sigmoid(), nn.BatchNorm1d(w), nn.Linear(w, 3)
            ),
            r"BatchNorm1d '2': it normalizes padded units holding f\(0\) != 0",
        ),
        (
            lambda w: nn.Sequential(
                nn.Conv1d(2, w, 3, groups=2), nn.Flatten(), nn.Linear(w * 6, 3)
            ),
            r"Conv1d '0': groups=2: padding channels would regroup them",
        ),
        (
            lambda w: nn.Sequential(
                nn.Linear(6, 8), nn.TransformerEncoderLayer(8, w // 4, w), nn.Linear(8, 3)
            ),
            r"differ only in the widths|nhead",
        ),
        (lambda w: Branchy(w), r"torch.fx cannot trace the member's forward"),
        (
            lambda w: nn.Sequential(nn.Linear(6, w), nn.ELU(0.1 * w / 4), nn.Linear(w, 3)),
            r"ELU\(alpha=0\.2",
        ),
    ],
    ids=[
        "layernorm",
        "softmax",
        "output",
        "input",
        "mean",
        "skip",
        "bn-after-sigmoid",
        "groups",
        "attention-heads",
        "untraceable",
        "other-setting",
    ],
)
def test_refused_where_padding_would_change_a_result(make, match: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=match):
        phalanx.stack([make(4), make(8)], pad_widths=True)


def test_attention_head_counts_are_named() -> None:
    class Attn(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.a = nn.Linear(6, width)
            self.att = nn.MultiheadAttention(width, 2, batch_first=True)
            self.b = nn.Linear(width, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(self.att(h, h, h, need_weights=False)[0])

    with pytest.raises(ValueError, match=r"attention splits the padded width into heads"):
        phalanx.stack([Attn(4), Attn(8)], pad_widths=True)


def test_a_copied_stack_masks_its_own_gradients() -> None:
    models, xs = members("mlp")  # a sigmoid first: unmasked padded gradients would be nonzero
    original = phalanx.stack(models, pad_widths=True)
    original(xs, in_dims=0).sum().backward()  # hooks on the original's parameters
    for stack in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        stack.zero_grad()
        stack(xs, in_dims=0).sum().backward()
        for name, p in stack.module.named_parameters():
            mask = stack.padding.mask(name, p)
            assert torch.equal(p.grad[~mask], torch.zeros_like(p.grad[~mask])), name
            assert p.grad[mask].abs().sum() > 0, name


def test_subset_calls_of_a_padded_stack_mask_their_gradients() -> None:
    models, xs = members("mlp")
    stack = phalanx.stack(models, pad_widths=True)
    whole = stack(xs, in_dims=0)
    out = stack(xs[[3, 1]], in_dims=0, subset=[3, 1])
    torch.testing.assert_close(out, whole[[3, 1]])
    out.sum().backward()
    for name, p in stack.module.named_parameters():
        mask = stack.padding.mask(name, p)
        assert torch.equal(p.grad[~mask], torch.zeros_like(p.grad[~mask])), name
        assert torch.equal(p.grad[[0, 2]], torch.zeros_like(p.grad[[0, 2]])), name


def _widths(widths: list[int], seed: int) -> phalanx.Stack:
    torch.manual_seed(seed)
    return phalanx.stack([mlp(w, 4) for w in widths], pad_widths=True)


def _padded_nonzero(stack: phalanx.Stack) -> int:
    assert stack.padding is not None
    return sum(
        int(((p != 0) & ~stack.padding.mask(n, p)).sum())
        for n, p in stack.module.named_parameters()
    )


def test_polyak_and_load_state_dict_refuse_members_of_other_widths(tmp_path) -> None:
    target, source = _widths([3, 5, 8], 0), _widths([8, 5, 3], 1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)same widths.*'module.0.weight' member 0: \(3, 6\) in "
                       r"the target, \(8, 6\) in the source"):  # fmt: skip
        phalanx.polyak_(target, source, 0.3)
    with pytest.raises(
        RuntimeError, match=r"(?s)other widths.*'module.0.weight' member 0: \(3, 6\)"
    ):
        target.load_state_dict(source.state_dict())
    path = tmp_path / "sd.pt"  # the widths travel with torch.save's state dict
    torch.save(source.state_dict(), path)
    with pytest.raises(RuntimeError, match="other widths"):
        target.load_state_dict(torch.load(path))
    # a plain dict has no metadata: the padded entries that are not 0 give it away
    with pytest.raises(RuntimeError, match=r"'module.0.weight' member 0 has nonzero entries"):
        target.load_state_dict(dict(source.state_dict()))
    one_width = phalanx.stack([mlp(8, 4) for _ in range(3)])
    with pytest.raises(RuntimeError, match="stack is padded to the widest, the state dict of one"):
        target.load_state_dict(one_width.state_dict())
    with pytest.raises(ValueError, match="target is padded to the widest, the source of one"):
        phalanx.polyak_(target, one_width, 0.5)
    for k, v in target.state_dict().items():  # every refusal left the target as it was
        assert torch.equal(v, before[k]), k
    assert _padded_nonzero(target) == 0
    # the same widths: accepted, and each member equal to its own module
    other = _widths([3, 5, 8], 2)
    phalanx.polyak_(target, other, 0.3)
    target.load_state_dict(dict(other.state_dict()))
    target.load_state_dict(other.state_dict())
    assert _padded_nonzero(target) == 0
    x = torch.randn(4, 6)
    for i, own in enumerate(target.unstack()):
        torch.testing.assert_close(target(x)[i], own(x))
