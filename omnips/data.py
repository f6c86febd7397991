"""Datasets, and the sample streams that decide which samples a worker trains on.

BSP: one global stream, the concatenation of per-epoch permutations seeded by
(job seed, epoch). Step t consumes positions [t*B, (t+1)*B); worker i takes the
slice after the batches of workers 0..i-1. Every sample is seen once per epoch
whatever the batch vector is, and nothing is re-partitioned when it changes.
ASP: each worker reads a stream of its own (seeded by job seed and rank).
"""

import importlib
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate


class FactoryError(ValueError):
    """A dataset or model that cannot be built; the text is one readable line."""


def one_line(exc: BaseException) -> str:
    """'Type: message' with the message's line breaks folded, for FactoryError texts."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class SampleStream:
    """Endless stream of indices into range(n): epoch e is a permutation seeded by (seed, stream, e)."""

    def __init__(self, n: int, seed: int, stream: int = 0):
        if n < 1:
            raise ValueError("a sample stream needs at least one sample")
        self.n, self.seed, self.stream = n, seed, stream
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, self.stream, epoch]).permutation(self.n)
            if len(self._cache) >= 2:  # positions only move forward: keep two epochs
                del self._cache[min(self._cache)]
            self._cache[epoch] = perm
        return perm

    def take(self, start: int, length: int) -> np.ndarray:
        """Indices at stream positions [start, start + length)."""
        out, pos, end = [], start, start + length
        while pos < end:
            epoch, offset = divmod(pos, self.n)
            chunk = self.permutation(epoch)[offset:offset + (end - pos)]
            out.append(chunk)
            pos += len(chunk)
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def bsp_slice_start(step_start: int, batches: list[int], rank: int) -> int:
    """Stream position where worker `rank`'s slice begins within a BSP step."""
    return step_start + sum(batches[:rank])


class Batcher:
    """Gathers (inputs, labels) for a list of indices; tensor datasets are sliced directly."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) else None

    def __call__(self, indices: np.ndarray):
        if self._tensors is not None:
            idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
            return self._tensors[0][idx], self._tensors[1][idx]
        return default_collate([self.dataset[int(i)] for i in indices])


def digits(test_fraction: float = 0.2, split_seed: int = 0):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images), as 1x8x8 floats in [0, 1].

    Read straight from the file scikit-learn ships (64 pixel columns, then the
    label): importing sklearn.datasets would cost every process 2-3 s of start-up.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else None
    if path is None or not path.exists():
        raise FactoryError("dataset 'digits' needs scikit-learn installed (it ships the data): pip install scikit-learn")
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :64].reshape(-1, 1, 8, 8) / 16.0)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    return _split(x, y, test_fraction, split_seed)


def synthetic(n: int = 4096, features: int = 64, classes: int = 10, test_fraction: float = 0.2,
              noise: float = 0.5, seed: int = 0):
    """A learnable classification task: labels from a random linear teacher plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher + noise * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return _split(x, y, test_fraction, seed)


def _split(x, y, test_fraction, seed):
    if not 0 < test_fraction < 1:
        raise FactoryError(f"test_fraction must be in (0, 1), not {test_fraction}")
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    n_test = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


BUILTIN = {"digits": digits, "synthetic": synthetic}


def import_factory(spec: str, what: str):
    """Resolve 'pkg.module:fn' to a callable, or raise one clear line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"{what} {spec!r} is neither built in nor of the form pkg.module:fn")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is reported alike
        raise FactoryError(f"{what} {spec!r}: cannot import {module_name}: {one_line(exc)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise FactoryError(f"{what} {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def load(name: str, args: dict) -> tuple[Dataset, Dataset]:
    """(train, test) for a built-in name or a user's 'pkg.module:fn' factory."""
    fn = BUILTIN.get(name) or import_factory(name, "dataset")
    try:
        result = fn(**args)
    except FactoryError:
        raise
    except Exception as exc:
        raise FactoryError(f"dataset {name!r} failed with {args}: {one_line(exc)}") from None
    if not (isinstance(result, tuple) and len(result) == 2
            and all(hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in result)):
        raise FactoryError(f"dataset {name!r} must return (train, test), two map-style datasets; "
                           f"got {type(result).__name__}")
    train, test = result
    if len(train) == 0 or len(test) == 0:
        raise FactoryError(f"dataset {name!r} returned an empty train or test set")
    return train, test
