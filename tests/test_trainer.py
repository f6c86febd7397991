"""A worker's compute phase: chunks give the same gradient, out-of-memory halves the chunk."""

import socket

import numpy as np
import pytest

from omnips import data, models
from omnips.flat import FlatModel
from omnips.server.service import advertised_host
from omnips.worker.trainer import Trainer


@pytest.fixture(scope="module")
def train():
    return data.load("digits", {})[0]


def _trainer(train, **kw):
    return Trainer(FlatModel(models.build("mlp", {}, train, seed=4)), data.Batcher(train), **kw)


def test_chunked_gradient_equals_the_whole_batch(train):
    idx = np.arange(40)
    whole, chunked = _trainer(train), _trainer(train, max_batch=7)
    loss_w, _ = whole.compute(idx)
    loss_c, _ = chunked.compute(idx)
    assert loss_c == pytest.approx(loss_w, rel=1e-5)
    np.testing.assert_allclose(chunked.flat.grads, whole.flat.grads, rtol=1e-4, atol=1e-6)
    assert np.abs(whole.flat.grads).sum() > 0


def test_out_of_memory_halves_the_chunk_and_redoes_the_step(train):
    idx = np.arange(40)
    reference = _trainer(train)
    reference.compute(idx)
    t = _trainer(train, fault_oom_above=12)
    t.compute(idx)
    assert t.max_batch == 10  # 40 -> 20 -> 10
    np.testing.assert_allclose(t.flat.grads, reference.flat.grads, rtol=1e-4, atol=1e-6)


def test_out_of_memory_with_one_sample_is_an_error(train):
    t = _trainer(train, fault_oom_above=0)
    t._fault_oom_above = -1  # every pass fails, even of one sample (len(part) > -1)
    with pytest.raises(MemoryError, match="single sample"):
        t.compute(np.arange(4))


def test_other_errors_are_not_mistaken_for_memory(train):
    t = _trainer(train)
    with pytest.raises(IndexError):
        t.compute(np.array([10**7]))
    assert t.max_batch == 0


def test_advertised_host():
    assert advertised_host("127.0.0.1", None) == "127.0.0.1"
    assert advertised_host("0.0.0.0", "node7") == "node7"
    assert advertised_host("0.0.0.0", None) == socket.gethostname()  # the default: this machine's name
