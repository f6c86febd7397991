"""The servers' optimizers follow torch.optim's update rules."""

import pytest
import torch

from omnips import optim

CASES = [
    ("sgd", dict(momentum=0.0, nesterov=False, weight_decay=0.0)),
    ("sgd", dict(momentum=0.9, nesterov=False, weight_decay=0.0)),
    ("sgd", dict(momentum=0.9, nesterov=False, weight_decay=0.01)),
    ("sgd", dict(momentum=0.8, nesterov=True, weight_decay=0.05)),
    ("adam", dict(weight_decay=0.0)),
    ("adam", dict(weight_decay=0.02)),
]


# parts at multiples of server.segments.ALIGN (the server re-cuts others there), applied last first,
# in one apply call (a push joined from parts) and in one call each (a step written range by range)
CUTS = {"whole": [0, 1000], "parts": [0, 64, 320, 384, 1000]}


@pytest.mark.parametrize("calls", ["one call", "a call a part"])
@pytest.mark.parametrize("cuts", CUTS.values(), ids=CUTS.keys())
@pytest.mark.parametrize("name,kw", CASES)
def test_matches_torch_optim_bit_for_bit(name, kw, cuts, calls):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=g)
    ours = start.clone()
    ref = torch.nn.Parameter(start.clone())
    if name == "sgd":
        opt = optim.SGD(ours, **kw)
        torch_opt = torch.optim.SGD([ref], lr=0.1, **kw)
    else:
        opt = optim.Adam(ours, **kw)
        torch_opt = torch.optim.Adam([ref], lr=0.1, **kw)
    for step in range(6):
        lr = 0.1 / (1 + step)  # ASP changes lr per update: both must honour it
        grad = torch.randn(1000, generator=g)
        segments = [(lo, grad[lo:hi]) for lo, hi in reversed(list(zip(cuts, cuts[1:])))]
        opt.begin(lr)
        for call in ([segments] if calls == "one call" else [[s] for s in segments]):
            opt.apply(call)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        ref.grad = grad.clone()
        torch_opt.step()
        assert torch.equal(ours, ref.detach()), (name, kw, step)
    assert not torch.equal(ours, start)
