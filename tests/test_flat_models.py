"""FlatModel's shared buffers, the built-in models, user factories, and JobSpec checks."""

import copy
import math
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from omnips import data, models
from omnips.data import FactoryError
from omnips.flat import PAGE, FlatModel, aligned_empty, aligned_zeros
from omnips.job import JobSpec


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def test_aligned_buffers():
    assert aligned_empty(0).shape == (0,)
    for n in (1, 1000, PAGE + 3):
        a = aligned_empty(n)
        assert a.dtype == np.float32 and a.shape == (n,) and a.ctypes.data % PAGE == 0
    z = aligned_zeros(77)
    assert z.ctypes.data % PAGE == 0 and not z.any()


def test_parameters_are_views_of_the_flat_buffer():
    net = small_net()
    ref = copy.deepcopy(net)
    flat = FlatModel(net)
    assert flat.size == flat.num_trained == 5 * 4 + 4 + 4 * 3 + 3
    # layout: named_parameters() order, values kept
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).numpy()
    np.testing.assert_array_equal(flat.params, expected)
    pos = 0
    for p in net.parameters():
        assert np.shares_memory(p.detach().numpy(), flat.params)
        assert p.data_ptr() == flat.params.ctypes.data + 4 * pos
        pos += p.numel()
    x = torch.randn(2, 5)
    torch.testing.assert_close(net(x), ref(x))
    # writing the flat buffer is writing the model
    flat.params[:] = 0
    flat.params[-3:] = [1, 2, 3]  # the last layer's bias
    with torch.no_grad():
        assert net(x).tolist() == [[1, 2, 3], [1, 2, 3]]
    new = np.random.default_rng(0).standard_normal(flat.size).astype(np.float32)
    np.copyto(flat.params, new)
    flat.load_params()
    np.testing.assert_array_equal(net[0].weight.detach().numpy().reshape(-1), new[:20])


def test_finish_grads_matches_autograd():
    net = small_net()
    ref = copy.deepcopy(net)
    flat = FlatModel(net)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(2):  # twice: zero_grads must really reset the accumulation
        flat.zero_grads()
        models.loss_fn(net(x), y).backward()
        flat.finish_grads()
    ref.zero_grad()
    models.loss_fn(ref(x), y).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy().copy()
    np.testing.assert_allclose(flat.grads, want, rtol=1e-6, atol=1e-7)
    assert np.abs(flat.grads).sum() > 0


def test_finish_grads_copies_home_gradients_autograd_replaced():
    net = small_net()
    ref = copy.deepcopy(net)
    flat = FlatModel(net)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    net.zero_grad(set_to_none=True)  # autograd will allocate fresh .grad tensors
    models.loss_fn(net(x), y).backward()
    assert net[0].weight.grad.data_ptr() != flat.grads.ctypes.data
    flat.finish_grads()
    models.loss_fn(ref(x), y).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy()
    np.testing.assert_allclose(flat.grads, want, rtol=1e-6, atol=1e-7)
    # and the .grad tensors are views of the flat buffer again
    assert net[0].weight.grad.data_ptr() == flat.grads.ctypes.data


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)
        self.use_b = True

    def forward(self, x):
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def test_unused_parameter_after_set_to_none_has_zero_gradient():
    torch.manual_seed(0)
    net = TwoBranches()
    flat = FlatModel(net)
    x = torch.randn(4, 3)
    net(x).sum().backward()
    flat.finish_grads()
    net.zero_grad(set_to_none=True)  # a user's training code may do this
    net.use_b = False
    net(x).sum().backward()
    flat.finish_grads()
    b_slots = slice(8, 16)  # a.weight, a.bias, then b.weight, b.bias
    assert not flat.grads[b_slots].any()


def test_a_buffer_two_modules_share_has_one_place_and_stays_shared():
    shared = torch.zeros(2)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for layer in net:
        layer.register_buffer("scale", shared)
    flat = FlatModel(net)
    assert flat.size == flat.num_trained + 2
    net[0].scale.add_(1)
    assert net[1].scale.tolist() == [1, 1] and flat.params[flat.num_trained:].tolist() == [1, 1]


def test_buffer_slots_follow_the_module_and_travel_in_grads():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    flat = FlatModel(net)
    bn = net[1]
    assert flat.num_trained == 4 * 3 + 3 + 3 + 3
    assert flat.size == flat.num_trained + 3 + 3  # running_mean, running_var (num_batches_tracked is int)
    nt = flat.num_trained
    np.testing.assert_array_equal(flat.params[nt:], [0, 0, 0, 1, 1, 1])
    flat.zero_grads()
    out = net(torch.randn(16, 4) * 3 + 1)
    out.sum().backward()
    # the running statistics were updated in place, inside the flat buffer
    np.testing.assert_array_equal(flat.params[nt:nt + 3], bn.running_mean.numpy())
    np.testing.assert_array_equal(flat.params[nt + 3:], bn.running_var.numpy())
    assert np.abs(flat.params[nt:nt + 3]).sum() > 0
    flat.finish_grads()
    np.testing.assert_array_equal(flat.grads[nt:], flat.params[nt:])  # buffer values ride in the push
    # and a pull that writes the buffer slots changes what the model uses in eval mode
    flat.params[nt:nt + 3] = [5, 5, 5]
    assert bn.running_mean.tolist() == [5, 5, 5]


def test_non_float32_parameters_are_refused():
    with pytest.raises(ValueError, match="float32"):
        FlatModel(nn.Linear(2, 2).double())


# -- built-in models ------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_train():
    train, _ = data.load("digits", {})
    return train


def test_chance_loss_is_the_entropy_of_the_label_frequencies(digits_train):
    assert models.chance_loss(digits_train) == pytest.approx(math.log(10), rel=1e-3)  # nearly balanced
    two = TensorDataset(torch.zeros(4, 1), torch.tensor([0, 0, 0, 1]))
    assert models.chance_loss(two) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    one = [(torch.zeros(1), 3)] * 5  # a dataset without tensors: labels read one by one
    assert models.chance_loss(one) == 0.0 and models.dataset_shape(one) == ((1,), 4)


@pytest.mark.parametrize("name, count", [("mlp", 17226), ("cnn", 6090), ("resnet", 77754)])
def test_builtin_models_for_digits(digits_train, name, count):
    assert models.dataset_shape(digits_train) == ((1, 8, 8), 10)
    a = models.build(name, {}, digits_train, seed=11)
    b = models.build(name, {}, digits_train, seed=11)
    c = models.build(name, {}, digits_train, seed=12)
    fa, fb, fc = FlatModel(a), FlatModel(b), FlatModel(c)
    assert fa.size == fb.size == count
    np.testing.assert_array_equal(fa.params, fb.params)  # every process builds the same model
    assert not np.array_equal(fa.params, fc.params)
    x, _ = data.Batcher(digits_train)(np.arange(5))
    assert a(x).shape == (5, 10)


def test_the_builtin_resnet_gives_a_sample_the_same_output_in_any_batch(digits_train):
    """GroupNorm normalises each sample on its own: in training mode a sample's output (and so
    its gradient) does not depend on which or how many samples share its batch, whatever
    batch size the controller gives a worker. A BatchNorm would fail this."""
    model = models.build("resnet", {}, digits_train, seed=3).train()
    x, _ = data.Batcher(digits_train)(np.arange(40))
    alone = torch.cat([model(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(model(x[:3]), alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(model(x)[:3], alone, rtol=0, atol=1e-5)


def test_model_args_reach_builtins(digits_train):
    def size(name, args):
        return sum(p.numel() for p in models.build(name, args, digits_train, seed=0).parameters())
    assert size("mlp", {"hidden": [7]}) == 64 * 7 + 7 + 7 * 10 + 10
    # a 3x3 convolution to 4 channels, pooled to 2x2, then the classifier
    assert size("cnn", {"channels": [4]}) == (9 * 4 + 4) + (4 * 4 * 10 + 10)
    # the stem (8 channels, GroupNorm), one block of two convolutions with their norms, the classifier
    assert size("resnet", {"width": 8, "stages": [1]}) == (9 * 8 + 16) + 2 * (9 * 8 * 8 + 16) + (8 * 10 + 10)
    assert size("resnet", {"width": 8, "stages": [2]}) == size("resnet", {"width": 8, "stages": [1]}) + 2 * (9 * 64 + 16)


def test_cnn_needs_image_inputs():
    train, _ = data.load("synthetic", {"n": 50, "features": 6})
    with pytest.raises(FactoryError, match="cnn needs"):
        models.build("cnn", {}, train, seed=0)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable module of user factories, good and bad."""
    name = "omnips_test_user_factories"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset

        def model(width=3):
            return torch.nn.Linear(4, width)

        def not_a_model():
            return "a string"

        def broken_model(**kw):
            raise RuntimeError("cannot build")

        def broken_model_long_text(**kw):
            raise RuntimeError("size mismatch\\n  expected [3, 4]\\n  got [4, 3]")

        def dataset(n=10):
            x, y = torch.randn(n, 4), torch.arange(n) % 3
            return TensorDataset(x, y), TensorDataset(x[:2], y[:2])

        def returns_list():
            x = TensorDataset(torch.zeros(2, 4), torch.zeros(2))
            return [x, x]

        def returns_three():
            x = TensorDataset(torch.zeros(2, 4), torch.zeros(2))
            return x, x, x

        def returns_numbers():
            return 1, 2

        def returns_empty():
            x = TensorDataset(torch.zeros(2, 4), torch.zeros(2))
            return x, TensorDataset(torch.zeros(0, 4), torch.zeros(0))

        def raises(**kw):
            raise ValueError("no such file")

        NOT_CALLABLE = 3
    """))
    (tmp_path / "omnips_test_broken_import.py").write_text("raise ImportError('missing dependency xyz')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in (name, "omnips_test_broken_import"):
        sys.modules.pop(mod, None)


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def test_user_factories_that_work(user_module):
    train, test = data.load(f"{user_module}:dataset", {"n": 12})
    assert (len(train), len(test)) == (12, 2)
    m = models.build(f"{user_module}:model", {"width": 5}, train, seed=0)
    assert isinstance(m, nn.Linear) and m.out_features == 5


@pytest.mark.parametrize("spec, match", [
    ("no_such_package_xyz.mod:fn", "cannot import"),
    ("omnips_test_broken_import:fn", "missing dependency xyz"),
    ("{mod}:nope", "no callable"),
    ("{mod}:NOT_CALLABLE", "no callable"),
    ("{mod}", "neither built in nor"),
    ("{mod}:", "neither built in nor"),
    (":model", "neither built in nor"),
    ("{mod}:not_a_model", "must return a torch.nn.Module"),
    ("{mod}:broken_model", "RuntimeError"),
])
def test_bad_model_factories(user_module, digits_train, spec, match):
    with pytest.raises(FactoryError, match=match) as info:
        models.build(spec.format(mod=user_module), {}, digits_train, seed=0)
    one_line(info)


def test_factory_error_with_multi_line_cause_is_one_line(user_module, digits_train):
    with pytest.raises(FactoryError, match="size mismatch") as info:
        models.build(f"{user_module}:broken_model_long_text", {}, digits_train, seed=0)
    one_line(info)


@pytest.mark.parametrize("fn, match", [
    ("returns_list", "must return \\(train, test\\)"),
    ("returns_three", "must return \\(train, test\\)"),
    ("returns_numbers", "must return \\(train, test\\)"),
    ("returns_empty", "empty"),
    ("raises", "ValueError: no such file"),
    ("nope", "no callable"),
])
def test_bad_dataset_factories(user_module, fn, match):
    with pytest.raises(FactoryError, match=match) as info:
        data.load(f"{user_module}:{fn}", {})
    one_line(info)


def test_bad_dataset_arguments():
    with pytest.raises(FactoryError, match="unexpected keyword") as info:
        data.load("synthetic", {"bogus": 1})
    one_line(info)
    with pytest.raises(FactoryError, match="test_fraction"):
        data.load("synthetic", {"n": 20, "test_fraction": 1.5})


# -- the job spec ---------------------------------------------------------------------


def test_default_job_is_valid():
    JobSpec().check()
    JobSpec(mode="asp", optimizer="adam", batching="static", momentum=0.0, max_steps=5, epochs=0).check()
    JobSpec(nesterov=True, momentum=0.5).check()


@pytest.mark.parametrize("changes, match", [
    ({"batching": "magic"}, "batching"),
    ({"mode": "sync"}, "mode"),
    ({"controller": "pid"}, "controller"),
    ({"adjust_every": 1}, "adjust-every"),
    ({"deadband": 1.0}, "deadband"),
    ({"min_batch": 0}, "min-batch"),
    ({"min_batch": 30, "num_workers": 3, "global_batch": 64}, "min-batch"),
    ({"max_batch": 10, "num_workers": 3, "global_batch": 64}, "max-batch"),
    ({"staleness": -1}, "staleness"),
    ({"staleness_lr": "sqrt"}, "staleness-lr"),
    ({"optimizer": "lbfgs"}, "optimizer"),
    ({"global_batch": 3, "num_workers": 4}, "smaller than"),
    ({"num_workers": 0}, "num-workers"),
    ({"num_servers": 0}, "num-servers"),
    ({"nesterov": True, "momentum": 0.0}, "nesterov"),
    ({"nesterov": True, "optimizer": "adam"}, "nesterov"),
    ({"lr": 0.0}, "lr"), ({"lr": -1.0}, "lr"), ({"lr": float("nan")}, "lr"),
    ({"momentum": 1.0}, "momentum"), ({"momentum": -0.1}, "momentum"),
    ({"weight_decay": -1e-4}, "weight-decay"),
    ({"max_steps": 0}, "max-steps"),
    ({"epochs": 0.0}, "epochs"), ({"epochs": -1.0}, "epochs"),
])
def test_bad_job_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        JobSpec(**changes).check()


@pytest.mark.parametrize("changes", [{"weight_decay": float("nan")}, {"epochs": float("inf")}])
def test_non_finite_job_settings_are_refused(changes):
    with pytest.raises(ValueError):
        JobSpec(**changes).check()


def test_from_dict_round_trip_and_unknown_keys():
    spec = JobSpec(mode="asp", num_workers=3, global_batch=30, seed=5, model_args={"hidden": [8]})
    assert JobSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown job settings"):
        JobSpec.from_dict({**spec.to_dict(), "colour": "red"})
    with pytest.raises(ValueError, match="smaller than"):
        JobSpec.from_dict({**spec.to_dict(), "global_batch": 2})


def test_sample_budget_and_steps():
    assert JobSpec(epochs=2.5, global_batch=64).sample_budget(1000) == 2500
    assert JobSpec(epochs=2.5, global_batch=64).total_steps(1000) == 40  # ceil(2500 / 64)
    assert JobSpec(max_steps=7, global_batch=10).total_steps(1000) == 7


def test_evaluate_ticks_between_small_batches_and_counts_every_sample():
    """The scheduler's heartbeats go out at each tick: a test set of 359 is read in batches of
    128 at most (see models.evaluate), and every sample is counted once."""
    torch.manual_seed(0)
    x, y = torch.randn(359, 5), torch.randint(0, 3, (359,))
    seen = []
    batcher = data.Batcher(TensorDataset(x, y))
    net = small_net()
    before = [p.clone() for p in net.parameters()]
    acc, loss = models.evaluate(net, lambda idx: seen.append(len(idx)) or batcher(idx), 359,
                                tick=lambda: seen.append("tick"))
    assert seen == [128, "tick", 128, "tick", 103, "tick"]
    assert net.training and all(torch.equal(p, q) for p, q in zip(net.parameters(), before))  # left as it was
    with torch.no_grad():
        out = small_net()(x)
    assert acc == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert loss == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)
