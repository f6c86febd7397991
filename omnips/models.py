"""Built-in models, the user's model factories, and evaluation.

Built-ins take `input_shape` and `num_classes`, filled in from the dataset unless
given in --model-args. The ResNet uses GroupNorm rather than BatchNorm: its output
does not depend on the batch size, which the dynamic batching policy changes per
worker at run time (a worker with 4 samples would otherwise get noisy statistics).
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

from .data import FactoryError, import_factory, one_line


def mlp(input_shape, num_classes, hidden=(128, 64)):
    layers, width = [nn.Flatten()], math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape, num_classes, channels=(16, 32)):
    if len(input_shape) != 3:
        raise FactoryError(f"cnn needs (channels, height, width) inputs, not {tuple(input_shape)}")
    layers, c_in = [], input_shape[0]
    for c in channels:
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
        c_in = c
    layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * c_in, num_classes)]
    return nn.Sequential(*layers)


class _Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        groups = min(8, c_out)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.skip = (nn.Sequential() if stride == 1 and c_in == c_out else
                     nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(groups, c_out)))

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.skip(x))


def resnet(input_shape, num_classes, width=16, stages=(1, 1, 1)):
    """A small ResNet: a stem, then stages of basic blocks, each stage doubling width."""
    if len(input_shape) != 3:
        raise FactoryError(f"resnet needs (channels, height, width) inputs, not {tuple(input_shape)}")
    layers = [nn.Conv2d(input_shape[0], width, 3, 1, 1, bias=False), nn.GroupNorm(min(8, width), width), nn.ReLU()]
    c = width
    for i, blocks in enumerate(stages):
        c_out = width * 2 ** i
        for b in range(blocks):
            layers.append(_Block(c, c_out, 2 if (b == 0 and i > 0) else 1))
            c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)


BUILTIN = {"mlp": mlp, "cnn": cnn, "resnet": resnet}


def labels(train) -> torch.Tensor:
    """Every label of a dataset of (input, label) pairs, as one integer tensor."""
    tensors = getattr(train, "tensors", None)
    if tensors is not None:
        return torch.as_tensor(tensors[1]).long()
    return torch.tensor([int(train[i][1]) for i in range(len(train))])


def dataset_shape(train) -> tuple[tuple, int]:
    """(input shape, number of classes) read off a dataset of (input, label) pairs."""
    x, _ = train[0]
    return tuple(torch.as_tensor(x).shape), int(labels(train).max()) + 1


def chance_loss(train) -> float:
    """The training loss of a model that learnt nothing but the label frequencies (their
    entropy, in nats): ln 10 for ten balanced classes."""
    p = torch.bincount(labels(train)).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def build(name: str, args: dict, train, seed: int) -> nn.Module:
    """The job's model, initialised from `seed` so every process builds the same one."""
    torch.manual_seed(seed)
    if name in BUILTIN:
        shape, classes = dataset_shape(train)
        kwargs = {"input_shape": shape, "num_classes": classes, **args}
        fn = BUILTIN[name]
    else:
        fn, kwargs = import_factory(name, "model"), dict(args)
    try:
        module = fn(**kwargs)
    except FactoryError:
        raise
    except Exception as exc:
        raise FactoryError(f"model {name!r} failed with {args}: {one_line(exc)}") from None
    if not isinstance(module, nn.Module):
        raise FactoryError(f"model {name!r} must return a torch.nn.Module, got {type(module).__name__}")
    return module


def loss_fn(output, target):
    """The training loss: a mean over the batch, so a worker's gradient is a batch mean."""
    return F.cross_entropy(output, target)


EVAL_BATCH = 128  # samples an evaluation reads at once (see evaluate)


@torch.no_grad()
def evaluate(module: nn.Module, batcher, size: int, device="cpu", batch: int = EVAL_BATCH,
             tick=None) -> tuple[float, float]:
    """(accuracy, mean loss) over the first `size` samples that `batcher` serves;
    `tick()` runs between batches (the scheduler keeps its heartbeats going there). Batches
    are small so that ticks come often: one forward of 359 samples through the cgroup
    benchmark's widened cnn took 0.45 s of CPU, and beside two other jobs' schedulers on a
    loaded host over 2 s, in which every worker held its step for want of a heartbeat."""
    was_training = module.training
    module.eval()
    correct, total_loss = 0, 0.0
    for start in range(0, size, batch):
        x, y = batcher(torch.arange(start, min(size, start + batch)).numpy())
        out = module(x.to(device))
        y = y.to(device)
        total_loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(dim=1) == y).sum().item()
        if tick is not None:
            tick()
    module.train(was_training)
    return correct / size, total_loss / size
