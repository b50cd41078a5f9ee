"""Tensor counts: exact, and never read on the host.

A count such as ``(y != -100).sum()`` lives on the gradients' device. Reading
it on the host (``.item()``, ``float()``, ``bool()``, a comparison in an
``if``) makes the host wait for the device, once per micro-batch. On the CPU
these tests count the operations that would do so on a GPU; with CUDA,
:func:`check_no_sync_on_cuda` runs the same steps under
``torch.cuda.set_sync_debug_mode('error')``.
"""

import contextlib

import numpy as np
import pytest
import torch
from skorch import NeuralNet
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from skorch_gradacc import AccumGrad, GradAccNeuralNet
from skorch_gradacc.counting import ItemCounts

DTYPE = torch.float64
PARAM_ATOL = 1e-10
IGNORE = -100

# what reads a tensor's value on the host: on a GPU, each waits for the device
SYNC_METHODS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
    torch.Tensor.cpu, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__int__, torch.Tensor.__index__,
}
SYNC_OPS = {
    torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero,
    torch.ops.aten.nonzero, torch.ops.aten.masked_select,
    torch.ops.aten.equal,
}


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_METHODS and self.calls.enabled:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNC_OPS and self.calls.enabled:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class SyncCalls(list):
    """The host reads of tensor values made while :func:`count_syncs` runs.

    ``enabled`` is False while the wrapped optimizer steps: a step may read
    its own state (Adam's step count lives on the CPU even for GPU
    parameters); what is checked is everything else.
    """

    enabled = True


@contextlib.contextmanager
def count_syncs():
    calls = SyncCalls()
    with _FunctionCounter(calls), _DispatchCounter(calls):
        yield calls


@contextlib.contextmanager
def cuda_sync_errors():
    """Make any synchronizing CUDA call raise; yields an object like
    :class:`SyncCalls` whose ``enabled`` switches the check, and always
    empty: a synchronizing call raises instead of being recorded."""
    class Switch(list):
        @property
        def enabled(self):
            return torch.cuda.get_sync_debug_mode() != 0

        @enabled.setter
        def enabled(self, value):
            torch.cuda.set_sync_debug_mode('error' if value else 'default')

    switch = Switch()
    torch.cuda.synchronize()
    switch.enabled = True
    try:
        yield switch
    finally:
        switch.enabled = False


def pause_during_step(optimizer, calls):
    """Leave the wrapped optimizer's own step out of the check."""
    def pause(*args):
        calls.enabled = False

    def resume(*args):
        calls.enabled = True

    return (optimizer.register_step_pre_hook(pause),
            optimizer.register_step_post_hook(resume))


def make_model(device='cpu'):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(16, 3, dtype=DTYPE)).to(device)


def token_data(device='cpu'):
    """48 rows, 4 groups of 3 micro-batches of 4 rows; partly ignored
    targets, two micro-batches and the whole last group without any."""
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(48, 10, dtype=DTYPE, generator=generator)
    y = torch.randint(0, 3, (48,), generator=generator)
    y[torch.rand(48, generator=generator) < 0.3] = IGNORE
    y[0:4] = IGNORE
    y[20:24] = IGNORE
    y[36:48] = IGNORE
    return X.to(device), y.to(device)


SIZES = [4, 2, 6, 4, 4, 4, 3, 5, 4, 4, 4, 4]  # unequal, then equal counts


def large_batch_model(X, y, make_opt, device='cpu'):
    model = make_model(device)
    opt = make_opt(model.parameters())
    for Xb, yb in zip(X.split(12), y.split(12)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(Xb), yb).backward()
        opt.step()
    return model


def accumulate(X, y, make_opt, sync_check, device='cpu'):
    """AccumGrad over the micro-batches of ``SIZES``, checked by
    ``sync_check``; returns the model and what the check recorded."""
    model = make_model(device)
    opt = AccumGrad(make_opt(model.parameters()), 3)
    with sync_check() as calls:
        pause_during_step(opt.optimizer, calls)
        for Xb, yb in zip(X.split(SIZES), y.split(SIZES)):
            opt.zero_grad()
            opt.set_count((yb != IGNORE).sum())
            torch.nn.functional.cross_entropy(model(Xb), yb).backward()
            opt.step()
        opt.flush()
    assert opt.position == 0
    return model, calls


def max_diff(model_a, model_b):
    return max((a - b).abs().max().item() for a, b in
               zip(model_a.parameters(), model_b.parameters()))


OPTIMIZERS = {
    'sgd': lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    'adam': lambda params: torch.optim.Adam(params, lr=0.01),
}


class TensorTokenNet(GradAccNeuralNet):
    """Counts non-ignored targets with a tensor, on the targets' device."""

    sync_check = staticmethod(count_syncs)

    def count_loss_items(self, batch):
        _, y = batch
        return (y != IGNORE).sum()

    def train_step(self, batch, **fit_params):
        with self.sync_check() as calls:
            step = super().train_step(batch, **fit_params)
        self.sync_calls_.extend(calls)
        return step

    def initialize(self):
        self.sync_calls_ = []
        return super().initialize()


class PythonTokenNet(TensorTokenNet):
    def count_loss_items(self, batch):
        return int(super().count_loss_items(batch))


def fit_nets(net_cls, device='cpu', sync_check=count_syncs):
    X, y = token_data(device)
    kwargs = dict(criterion=torch.nn.CrossEntropyLoss, lr=0.1,
                  optimizer__momentum=0.9, max_epochs=2, train_split=None,
                  verbose=0, device=device)
    large = NeuralNet(make_model, batch_size=12, **kwargs)
    # check_loss reads its verdict on the host, once per fit, by design
    net = net_cls(make_model, batch_size=4, acc_steps=3, check_loss=False,
                  **kwargs)
    net.sync_check = sync_check
    large.fit(X, y)
    net.fit(X, y)
    return net, large


@pytest.fixture
def cpu_as_device(monkeypatch):
    """Count CPU tensors as if they were on a GPU: never read on the host."""
    monkeypatch.setattr(ItemCounts, 'host_devices', frozenset())


class TestAccumGrad:
    @pytest.mark.usefixtures('cpu_as_device')
    @pytest.mark.parametrize('name', list(OPTIMIZERS))
    def test_tensor_counts_are_exact_without_a_host_read(self, name):
        X, y = token_data()
        large = large_batch_model(X, y, OPTIMIZERS[name])
        model, calls = accumulate(X, y, OPTIMIZERS[name], count_syncs)
        assert calls == []
        assert max_diff(model, large) <= PARAM_ATOL
        assert max_diff(model, make_model()) > 1e-2

    def test_python_counts_read_nothing_either(self):
        X, y = token_data()
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd'](model.parameters()), 3)
        counts = [int((yb != IGNORE).sum()) for yb in y.split(SIZES)]
        with count_syncs() as calls:
            for Xb, yb, count in zip(X.split(SIZES), y.split(SIZES), counts):
                opt.set_count(count)
                torch.nn.functional.cross_entropy(model(Xb), yb).backward()
                opt.step()
        assert calls == []

    def test_cpu_tensor_counts_are_read(self):
        # on the CPU, item() waits for no device: a count is read once
        X, y = token_data()
        large = large_batch_model(X, y, OPTIMIZERS['adam'])
        model, calls = accumulate(X, y, OPTIMIZERS['adam'], count_syncs)
        assert calls.count('item') == len(SIZES)
        assert max_diff(model, large) <= PARAM_ATOL


class TestMixin:
    @pytest.mark.usefixtures('cpu_as_device')
    def test_tensor_counts_are_exact_without_a_host_read(self):
        net, large = fit_nets(TensorTokenNet)
        assert net.sync_calls_ == []
        assert max_diff(net.module_, large.module_) <= PARAM_ATOL
        np.testing.assert_allclose(
            net.history[:, 'batches', :, 'train_loss'],
            large.history[:, 'batches', :, 'train_loss'], rtol=1e-10)
        assert np.isnan(net.history[-1, 'batches', -1, 'train_loss'])

    @pytest.mark.usefixtures('cpu_as_device')
    def test_validation_in_pieces_reads_no_count(self):
        X, y = token_data()
        net = TensorTokenNet(make_model, criterion=torch.nn.CrossEntropyLoss,
                             batch_size=12, micro_batch_size=5, verbose=0)
        net.initialize()
        whole = NeuralNet(make_model, criterion=torch.nn.CrossEntropyLoss,
                          batch_size=12).initialize()
        for Xb, yb in zip(X.split(12), y.split(12)):
            with count_syncs() as calls:
                loss = net.validation_step((Xb, yb))['loss']
            assert calls == []
            np.testing.assert_allclose(
                loss.item(), whole.validation_step((Xb, yb))['loss'].item(),
                rtol=1e-10)

    def test_python_counts_are_exact_and_are_read(self):
        # the same data with int counts: the same parameters; the counting
        # is done by count_loss_items itself, one read per micro-batch
        net, large = fit_nets(PythonTokenNet)
        assert max_diff(net.module_, large.module_) <= PARAM_ATOL
        assert len(net.sync_calls_) >= 2 * 12


class TestTheCounter:
    @pytest.mark.parametrize('read', [
        lambda t: t.item(), float, int, bool, lambda t: t.tolist(),
        lambda t: t.numpy(), lambda t: t.cpu(), lambda t: t == 0 or None,
        lambda t: [1, 2][t], lambda t: t.nonzero()])
    def test_it_sees_each_host_read(self, read):
        count = torch.tensor(1)
        with count_syncs() as calls:
            read(count)
        assert calls

    @pytest.mark.usefixtures('cpu_as_device')
    def test_it_sees_a_read_of_counts_in_accum_grad(self, monkeypatch):
        # AccumGrad as it was: set_count read the tensor with .item()
        set_count = AccumGrad.set_count
        monkeypatch.setattr(AccumGrad, 'set_count',
                            lambda self, count: set_count(self, count.item()))
        X, y = token_data()
        _, calls = accumulate(X, y, OPTIMIZERS['sgd'], count_syncs)
        assert calls.count('item') == len(SIZES)


def check_no_sync_on_cuda():
    """Run AccumGrad groups and a GradAcc net's steps, with tensor counts on
    CUDA, under ``torch.cuda.set_sync_debug_mode('error')``; check both
    against the large batch. Any synchronizing call raises."""
    X, y = token_data('cuda')
    for make_opt in OPTIMIZERS.values():
        large = large_batch_model(X, y, make_opt, 'cuda')
        model, _ = accumulate(X, y, make_opt, cuda_sync_errors, 'cuda')
        assert max_diff(model, large) <= PARAM_ATOL
    net, large = fit_nets(TensorTokenNet, 'cuda', cuda_sync_errors)
    assert max_diff(net.module_, large.module_) <= PARAM_ATOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_no_sync_on_cuda():
    check_no_sync_on_cuda()
