"""torch's built-in losses in member_losses: one call on (N, B, ...), no vmap, each member's
loss and gradient equal to its own call to float rounding (against the float64 loop)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import phalanx
import phalanx.train._losses as losses_module

N, B, D, C = 4, 6, 3, 5


def _no_vmap(*args, **kwargs):
    raise AssertionError("member_losses ran a built-in loss under vmap")


def _leaf(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == "prob":  # an input in (0, 1), as binary_cross_entropy takes
        x = torch.rand(shape) * 0.9 + 0.05
    elif kind == "positive":
        x = torch.rand(shape) + 0.1
    elif kind == "logprob":
        x = torch.randn(shape).log_softmax(-1)
    else:
        x = torch.randn(shape)
    return x.requires_grad_()


def _target(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == "prob":
        return torch.rand(shape)
    if kind == "count":
        return torch.randint(0, 5, shape).float()
    if kind == "dist":
        return torch.rand(shape).softmax(-1)
    if kind == "logdist":
        return torch.rand(shape).log_softmax(-1)
    if kind == "positive":
        return torch.rand(shape) + 0.1
    if kind == "class":
        return torch.randint(0, C, shape)
    return torch.randn(shape)


# (loss, input kind, target kinds (one per target), keywords)
ELEMENTWISE = [
    (F.mse_loss, "normal", ["normal"], {}),
    (F.l1_loss, "normal", ["normal"], {}),
    (F.smooth_l1_loss, "normal", ["normal"], {"beta": 0.5}),
    (F.huber_loss, "normal", ["normal"], {"delta": 0.7}),
    (F.binary_cross_entropy, "prob", ["prob"], {}),
    (F.binary_cross_entropy, "prob", ["prob"], {"weight": torch.rand(D) + 0.5}),
    (F.binary_cross_entropy_with_logits, "normal", ["prob"], {}),
    (
        F.binary_cross_entropy_with_logits,
        "normal",
        ["prob"],
        {"weight": torch.rand(D) + 0.5, "pos_weight": torch.rand(D) + 0.5},
    ),
    (F.kl_div, "logprob", ["dist"], {}),
    (F.kl_div, "logprob", ["logdist"], {"log_target": True}),
    (F.poisson_nll_loss, "normal", ["count"], {}),
    (F.poisson_nll_loss, "positive", ["count"], {"log_input": False, "full": True}),
    (F.gaussian_nll_loss, "normal", ["normal", "positive"], {}),
    (F.gaussian_nll_loss, "normal", ["normal", "positive"], {"full": True, "eps": 1e-3}),
]


def _check(loss_fn, out, targets, in_dims, kwargs, monkeypatch):
    """member_losses against each member's own call, float32 and float64, loss and gradient."""
    monkeypatch.setattr(losses_module, "vmap", _no_vmap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kl_div's reduction="mean" warning, tested below
        losses = phalanx.member_losses(loss_fn, out, *targets, in_dims=in_dims, **kwargs)
    assert losses.shape == (N,)
    grad = torch.autograd.grad(losses.sum(), out)[0]
    out64 = out.detach().double().requires_grad_()
    kw64 = {k: v.double() if torch.is_tensor(v) else v for k, v in kwargs.items()}

    def own(o, member, kw, double):
        ts = [t[member] if d == 0 else t for t, d in zip(targets, in_dims[1:])]
        ts = [t.double() if double and t.is_floating_point() else t for t in ts]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return loss_fn(o[member], *ts, **kw)

    for i in range(N):
        loop, loop64 = own(out, i, kwargs, False), own(out64, i, kw64, True)
        what = f"{loss_fn.__name__} {kwargs} member {i}"
        phalanx.testing.assert_equal_to_loop(losses[i], loop, loop64, what=f"{what} loss")
        g, g64 = (torch.autograd.grad(v, o)[0][i] for v, o in ((loop, out), (loop64, out64)))
        phalanx.testing.assert_equal_to_loop(grad[i], g, g64, what=f"{what} gradient")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_member"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "batchmean"])
@pytest.mark.parametrize(("loss_fn", "kind", "targets", "kwargs"), ELEMENTWISE)
def test_elementwise_losses_equal_each_members_own_call(
    loss_fn, kind, targets, kwargs, reduction, shared, monkeypatch
):
    if reduction == "batchmean" and loss_fn is not F.kl_div:
        pytest.skip("batchmean is kl_div's own reduction")
    torch.manual_seed(0)
    out = _leaf(kind, (N, B, D))
    shape = (B, D) if shared else (N, B, D)
    ts = [_target(t, shape) for t in targets]
    in_dims = (0, *([None] if shared else [0]) * len(ts))
    _check(loss_fn, out, ts, in_dims, {**kwargs, "reduction": reduction}, monkeypatch)


@pytest.mark.parametrize("var_shape", [(N, B), (N, B, 1)], ids=["one_per_row", "last_dim_1"])
def test_gaussian_nll_with_a_variance_per_row_and_mixed_in_dims(var_shape, monkeypatch):
    # F.gaussian_nll_loss died under vmap with torch's raw "data-dependent control flow"
    torch.manual_seed(0)
    out = _leaf("normal", (N, B, D))
    y, var = _target("normal", (B, D)), _target("positive", var_shape)
    _check(F.gaussian_nll_loss, out, [y, var], (0, None, 0), {}, monkeypatch)
    _check(F.gaussian_nll_loss, out, [y], (0, None), {"var": var[0]}, monkeypatch)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_member"])
@pytest.mark.parametrize(
    ("loss_fn", "kwargs"),
    [
        (F.cross_entropy, {}),
        (F.cross_entropy, {"weight": torch.rand(C) + 0.5}),
        (F.cross_entropy, {"ignore_index": 2}),
        (F.cross_entropy, {"label_smoothing": 0.1, "weight": torch.rand(C) + 0.5}),
        (F.cross_entropy, {"label_smoothing": 0.2, "ignore_index": 1}),
        (F.nll_loss, {"weight": torch.rand(C) + 0.5, "ignore_index": 0}),
    ],
)
def test_class_losses_equal_each_members_own_call(loss_fn, kwargs, shared, reduction, monkeypatch):
    torch.manual_seed(0)
    out = _leaf("logprob" if loss_fn is F.nll_loss else "normal", (N, B, C))
    y = _target("class", (B,) if shared else (N, B))
    if not shared:
        y[1] = kwargs.get("ignore_index", -100)  # member 1's batch entirely ignored
        y[1, 0] = 3
    in_dims = (0, None if shared else 0)
    _check(loss_fn, out, [y], in_dims, {**kwargs, "reduction": reduction}, monkeypatch)


def test_class_probabilities_and_spatial_dims(monkeypatch):
    torch.manual_seed(0)
    out = _leaf("normal", (N, B, C, 2))
    probs = torch.rand(N, B, C, 2).softmax(2)
    _check(F.cross_entropy, out, [probs], (0, 0), {"label_smoothing": 0.1}, monkeypatch)
    classes = _target("class", (B, 2))
    _check(F.cross_entropy, out, [classes], (0, None), {"weight": torch.rand(C)}, monkeypatch)


def test_a_member_with_every_sample_ignored_gets_nan_as_its_own_call(monkeypatch):
    monkeypatch.setattr(losses_module, "vmap", _no_vmap)
    out = torch.randn(N, B, C)
    y = torch.randint(0, C, (N, B))
    y[2] = -100
    losses = phalanx.member_losses(F.cross_entropy, out, y, in_dims=(0, 0))
    own = torch.stack([F.cross_entropy(out[i], y[i]) for i in range(N)])
    assert torch.equal(losses.isnan(), own.isnan()) and bool(losses[2].isnan())
    torch.testing.assert_close(losses[[0, 1, 3]], own[[0, 1, 3]])


def test_kl_div_mean_warns_as_torch_does():
    out, y = torch.randn(N, B, D).log_softmax(-1), torch.rand(B, D).softmax(-1)
    with pytest.warns(UserWarning, match="'batchmean' divides only by the batch size"):
        phalanx.member_losses(F.kl_div, out, y)


def test_a_loss_of_your_own_with_several_targets_runs_under_vmap():
    torch.manual_seed(0)
    out, y, var = torch.randn(N, B, D), torch.randn(N, B, D), torch.rand(N, B, D) + 0.1

    def nll(o, target, v):
        return (((o - target) ** 2) / v + v.log()).mean()

    losses = phalanx.member_losses(nll, out, y, var, in_dims=(0, 0, 0))
    torch.testing.assert_close(losses, torch.stack([nll(out[i], y[i], var[i]) for i in range(N)]))
    shared = phalanx.member_losses(nll, out, y[0], var[0])  # default in_dims: targets shared
    torch.testing.assert_close(shared, torch.stack([nll(out[i], y[0], var[0]) for i in range(N)]))


def test_vmap_refusals_in_a_loss_of_your_own_say_what_to_do():
    out, y, var = torch.randn(N, B, D), torch.randn(N, B, D), torch.rand(N, B, D) + 0.1

    def mine(o, target, v):
        return F.gaussian_nll_loss(o, target, v)  # checks its variances in Python

    with pytest.raises(RuntimeError, match=r"member_losses\(\): loss_fn 'mine' cannot run .*"
                       r"vmap.*data-dependent.*F\.gaussian_nll_loss"):  # fmt: skip
        phalanx.member_losses(mine, out, y, var, in_dims=(0, 0, 0))
    with pytest.raises(RuntimeError, match=r"loss_fn '<lambda>' cannot run.*\.item\(\)"):
        phalanx.member_losses(lambda o, t: F.mse_loss(o, t) * o.sum().item(), out, y[0])


def test_in_dims_needs_one_entry_per_target():
    out, y = torch.randn(N, B, D), torch.randn(N, B, D)
    with pytest.raises(ValueError, match=r"one entry for the output and each of the 2 targets"):
        phalanx.member_losses(F.gaussian_nll_loss, out, y, y.abs(), in_dims=(0, 0))
    with pytest.raises(ValueError, match=r"target 2 has the output's shape"):
        phalanx.member_losses(F.gaussian_nll_loss, out, y[0], y.abs())
