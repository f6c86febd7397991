"""Digests that tell whether two processes built the same model and loaded the same data.

Every process builds the job's model and data set from its own installed code. The
parameter count alone misses code that differs with the same number of values (a Tanh
for a ReLU trained 153 steps without a word): the model's digest covers each module's
name and type and each parameter's and buffer's name, shape and dtype. The data set's
covers its sizes and a few samples spread over each split (not every byte: a data set
may be gigabytes), enough to tell another file, seed or split.
"""

import hashlib

import numpy as np
import torch
from torch import nn

SAMPLES = 8  # samples per split that the data digest reads


def model(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, m in module.named_modules():
        h.update(f"module {name} {type(m).__module__}.{type(m).__qualname__}\n".encode())
    for kind, named in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            h.update(f"{kind} {name} {tuple(t.shape)} {t.dtype}\n".encode())
    return h.hexdigest()[:16]


def data(train, test) -> str:
    h = hashlib.sha256()
    for split in (train, test):
        n = len(split)
        h.update(f"split {n}\n".encode())
        for i in sorted({int(i) for i in np.linspace(0, n - 1, SAMPLES)}):
            for part in split[i]:
                t = torch.as_tensor(part)
                h.update(f"{tuple(t.shape)} {t.dtype}\n".encode())
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
