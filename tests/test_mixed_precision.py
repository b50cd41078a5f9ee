"""``mixed_precision``: autocast forward passes, and for fp16 a GradScaler
used the way accumulation needs it: every micro-batch's loss scaled,
gradients unscaled once per group before callbacks, one scaler step and
update per group, and a scaler-skipped step does not advance schedulers."""

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, LRScheduler

from skorch_gradacc import GradAccMixin, GradAccNeuralNetClassifier

from conftest import classification_data, fit_seeded, param_diff


class Float32MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 32)
        self.output = torch.nn.Linear(32, 3)

    def forward(self, X):
        hidden = self.hidden(X)
        if self.training:
            self.train_dtype_ = hidden.dtype
        logits = self.output(torch.tanh(hidden))
        return torch.softmax(logits.float(), dim=-1)


class AutocastBF16Net(NeuralNetClassifier):
    """The ground truth: plain skorch with its forward under bf16 autocast."""

    def train_step_single(self, batch, **fit_params):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            return super().train_step_single(batch, **fit_params)


class RecordGradNorms(Callback):
    def initialize(self):
        self.norms_ = []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        self.norms_.append(torch.norm(torch.stack(
            [p.grad.norm() for _, p in named_parameters])).item())


class CountingGradScaler(torch.amp.GradScaler):
    """A real GradScaler that counts its step and update calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps, self.updates = 0, 0

    def step(self, optimizer, *args, **kwargs):
        self.steps += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.updates += 1
        return super().update(new_scale)


class CountingScalerNet(GradAccNeuralNetClassifier):
    def _get_grad_scaler(self):
        if getattr(self, 'grad_scaler_', None) is None:
            self.grad_scaler_ = CountingGradScaler('cpu', init_scale=2.0 ** 8)
        return self.grad_scaler_


def data():
    X, y = classification_data(203)
    return X.astype(np.float32), y


COMMON = dict(max_epochs=2, train_split=None, verbose=0, lr=0.1,
              iterator_train__shuffle=True)


def test_bf16_matches_large_batch_net_under_autocast():
    X, y = data()
    acc_net = fit_seeded(GradAccNeuralNetClassifier(
        Float32MLP, batch_size=8, acc_steps=4, mixed_precision='bf16',
        **COMMON), X, y)
    plain = fit_seeded(AutocastBF16Net(Float32MLP, batch_size=32, **COMMON),
                       X, y)
    fp32 = fit_seeded(NeuralNetClassifier(Float32MLP, batch_size=32, **COMMON),
                      X, y)

    assert acc_net.module_.train_dtype_ == torch.bfloat16
    assert fp32.module_.train_dtype_ == torch.float32
    # bf16 rounds differently in micro-batches than in the whole batch, so
    # the match is to bf16 precision, not to float64's
    assert param_diff(acc_net, plain) < 2e-3
    np.testing.assert_allclose(acc_net.history[:, 'train_loss'],
                               plain.history[:, 'train_loss'], rtol=1e-2)


class TestFloat16GradScaler:
    def fit(self, **kwargs):
        X, y = data()
        net = CountingScalerNet(
            Float32MLP, batch_size=8, acc_steps=4, mixed_precision='fp16',
            callbacks=[('norms', RecordGradNorms()),
                       ('lr', LRScheduler(torch.optim.lr_scheduler.StepLR,
                                          step_size=1, gamma=0.9,
                                          step_every='batch'))],
            **{**COMMON, **kwargs})
        return fit_seeded(net, X, y)

    def test_loss_and_gradients_are_unscaled(self):
        net = self.fit()
        X, y = data()
        fp32 = fit_seeded(GradAccNeuralNetClassifier(
            Float32MLP, batch_size=8, acc_steps=4,
            callbacks=[('norms', RecordGradNorms())], **COMMON), X, y)
        # the reported loss is the loss, not the scaled one
        np.testing.assert_allclose(net.history[0, 'batches', 0, 'train_loss'],
                                   fp32.history[0, 'batches', 0, 'train_loss'],
                                   rtol=1e-2)
        # on_grad_computed saw the true gradient of the first group
        first = dict(net.callbacks_)['norms'].norms_[0]
        expected = dict(fp32.callbacks_)['norms'].norms_[0]
        assert first == pytest.approx(expected, rel=2e-2)

    def test_one_scaler_step_and_update_per_group(self):
        net = self.fit()
        steps = sum(net.history[:, 'train_batch_count'])
        assert net.grad_scaler_.updates == steps == 14
        assert net.grad_scaler_.steps == steps  # one optimizer

    def test_skipped_step_does_not_advance_the_scheduler(self):
        # a huge initial scale overflows float16 in the first groups, until
        # the scaler has lowered it far enough
        net = self.fit()
        net.grad_scaler_ = None
        net.set_params(max_epochs=1)

        class HugeScaleNet(CountingScalerNet):
            def _get_grad_scaler(self):
                if getattr(self, 'grad_scaler_', None) is None:
                    self.grad_scaler_ = CountingGradScaler(
                        'cpu', init_scale=2.0 ** 30)
                return self.grad_scaler_

        net = HugeScaleNet(**net.get_params())
        fit_seeded(net, *data())
        skipped = net.history[0, 'skipped_steps']
        applied = net.history[0, 'train_batch_count'] - skipped
        assert skipped >= 1
        assert net.optimizer_.param_groups[0]['lr'] == pytest.approx(
            0.1 * 0.9 ** applied, rel=1e-9)
        assert all(torch.isfinite(p).all() for p in net.module_.parameters())

    def test_loss_computed_without_get_loss_is_refused(self):
        class Unscaled(GradAccNeuralNetClassifier):
            def train_step_single(self, batch, **fit_params):
                Xi, yi = batch
                loss = self.criterion_(torch.log(self.infer(Xi)), yi)
                loss.backward()
                return {'loss': loss, 'y_pred': None}

        net = Unscaled(Float32MLP, batch_size=8, acc_steps=4,
                       mixed_precision='fp16', **COMMON)
        msg = ("GradAccMixin weights each micro-batch's loss (and, with "
               "mixed_precision='fp16', scales it) as it leaves get_loss; an "
               "override of train_step_single must compute the loss with "
               "self.get_loss(..., training=True).")
        with pytest.raises(RuntimeError) as exc:
            fit_seeded(net, *data())
        assert str(exc.value) == msg
        # refused at the first micro-batch, before any step
        assert not net.history[-1, 'batches'][0].get('train_loss')


class CountingOwnNet(NeuralNetClassifier):
    """A user's net with its own train_step_single, behind or in front of
    the mixin, as in ``class MyNet(GradAccMixin, MyOwnNet)``."""

    def train_step_single(self, batch, **fit_params):
        self.own_calls_ = getattr(self, 'own_calls_', 0) + 1
        return super().train_step_single(batch, **fit_params)


class MixinFirstNet(GradAccMixin, CountingOwnNet):
    pass


class OwnFirstNet(CountingOwnNet, GradAccNeuralNetClassifier):
    pass


@pytest.mark.parametrize('net_cls', [MixinFirstNet, OwnFirstNet])
@pytest.mark.parametrize('mixed_precision', [None, 'bf16', 'fp16'])
def test_train_step_single_override_runs_in_either_order(
        net_cls, mixed_precision):
    X, y = data()
    net = fit_seeded(net_cls(Float32MLP, batch_size=8, acc_steps=4,
                             mixed_precision=mixed_precision, **COMMON), X, y)
    # once per micro-batch: 26 micro-batches of 203 rows, 2 epochs
    assert net.own_calls_ == 52
    expected = {None: torch.float32, 'bf16': torch.bfloat16,
                'fp16': torch.float16}[mixed_precision]
    assert net.module_.train_dtype_ == expected
    reference = fit_seeded(GradAccNeuralNetClassifier(
        Float32MLP, batch_size=8, acc_steps=4, mixed_precision=mixed_precision,
        **COMMON), X, y)
    for p, q in zip(net.module_.parameters(), reference.module_.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_fp16_on_cuda_matches_fp32_closely():
    X, y = data()
    kwargs = dict(COMMON, device='cuda')
    amp = fit_seeded(GradAccNeuralNetClassifier(
        Float32MLP, batch_size=8, acc_steps=4, mixed_precision='fp16',
        **kwargs), X, y)
    fp32 = fit_seeded(GradAccNeuralNetClassifier(
        Float32MLP, batch_size=8, acc_steps=4, **kwargs), X, y)
    np.testing.assert_allclose(amp.history[:, 'train_loss'],
                               fp32.history[:, 'train_loss'], rtol=5e-2)


@pytest.mark.parametrize('value', ['fp8', 'float16', True, torch.float16])
def test_bad_values(value):
    net = GradAccNeuralNetClassifier(Float32MLP, mixed_precision=value)
    with pytest.raises(ValueError) as exc:
        net.initialize()
    assert str(exc.value) == (
        "mixed_precision must be None, 'bf16' or 'fp16', got {!r} instead."
        .format(value))
