"""skorch's contracts hold: train_step's return value, users' overrides of
get_loss and train_step_single, and closure optimizers."""

import numpy as np
import pytest
import torch
from skorch import NeuralNet, NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.dataset import unpack_data

from skorch_gradacc import (
    GradAccMixin,
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
    LossItemsWarning,
)
from skorch_gradacc.grouping import MicroBatchGroup

from conftest import (
    DTYPE,
    PARAM_ATOL,
    MLPClassifier,
    RecordParams,
    assert_same_history,
    classification_data,
    fit_seeded,
    make_nets,
    max_param_diff,
)


class L2Mixin:
    """A user's get_loss override: adds a penalty to the mean loss."""

    def get_loss(self, y_pred, y_true, X=None, training=False):
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        penalty = sum((p ** 2).sum() for p in self.module_.parameters())
        return loss + 1e-2 * penalty


class L2GradAccNet(L2Mixin, GradAccNeuralNetClassifier):
    pass


class L2Net(L2Mixin, NeuralNetClassifier):
    pass


class CountingGradAccNet(GradAccNeuralNetClassifier):
    """A user's train_step_single override that calls super()."""

    def train_step_single(self, batch, **fit_params):
        self.calls_ = getattr(self, 'calls_', 0) + 1
        return super().train_step_single(batch, **fit_params)


class StepRecorder:
    """Keep what train_step got and returned, for each training batch."""

    def train_step(self, batch, **fit_params):
        step = super().train_step(batch, **fit_params)
        self.steps_ = getattr(self, 'steps_', []) + [(type(batch), step)]
        return step


class RecordingGradAccNet(StepRecorder, GradAccNeuralNetClassifier):
    pass


class RecordingNet(StepRecorder, NeuralNetClassifier):
    pass


class ReadsOutputs(Callback):
    """A callback that reads y_pred, so that train_step returns it."""

    train_batch_reads = ('y_pred',)

    def on_batch_end(self, net, y_pred=None, training=False, **kwargs):
        pass


@pytest.mark.parametrize('reader', [True, False])
def test_train_step_returns_loss_and_y_pred(clf_data, reader):
    # the package's train_step, on a group of 4 micro-batches, returns what
    # skorch's returns for the union: the mean loss, and the outputs for
    # every row if a callback reads them (else None)
    X, y = clf_data
    callbacks = [('reads', ReadsOutputs())] if reader else []
    acc_net, plain_net = make_nets(4, max_epochs=1, callbacks=callbacks)
    acc_net = RecordingGradAccNet(**acc_net.get_params())
    plain_net = RecordingNet(**plain_net.get_params())
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert len(acc_net.steps_) == len(plain_net.steps_) == 6
    for (batch_type, step), (_, expected) in zip(acc_net.steps_,
                                                 plain_net.steps_):
        assert batch_type is MicroBatchGroup
        assert set(step) == {'loss', 'y_pred'}
        # as skorch's: requires grad; but no graph is kept
        assert step['loss'].ndim == 0 and step['loss'].requires_grad
        assert step['loss'].grad_fn is None
        torch.testing.assert_close(step['loss'], expected['loss'].detach(),
                                   rtol=1e-12, atol=0)
        if reader:
            assert not step['y_pred'].requires_grad
            torch.testing.assert_close(step['y_pred'], expected['y_pred'],
                                       rtol=1e-10, atol=1e-12)
        else:
            assert step['y_pred'] is None


def test_get_loss_override_is_used(clf_data):
    X, y = clf_data
    acc_net, plain_net = make_nets(4)
    acc_net = L2GradAccNet(**acc_net.get_params())
    plain_net = L2Net(**plain_net.get_params())
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


class WeightedLoss:
    """A user's get_loss with an argument of its own, which the user's
    train_step_single passes (skorch's FAQ on sample weights)."""

    def get_loss(self, y_pred, y_true, X=None, training=False, weight=1.0):
        return weight * super().get_loss(y_pred, y_true, X=X, training=training)

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        y_pred = self.infer(Xi['data'], **fit_params)  # a dict the module can't take
        loss = self.get_loss(y_pred, yi, X=Xi, training=True, weight=2.0)
        loss.backward()
        return {'loss': loss, 'y_pred': y_pred}


class WeightedGradAccNet(WeightedLoss, GradAccNeuralNetClassifier):
    pass


class WeightedNet(WeightedLoss, NeuralNetClassifier):
    pass


def test_overrides_of_their_own_signature_train_as_plain_skorch(clf_data):
    # get_loss's arguments reach it; the loss check, which cannot run the
    # user's step, warns that it did not check and the fit goes on exactly
    X, y = clf_data
    acc_net, plain_net = make_nets(4, train_split=None)  # skorch validates with infer
    acc_net = WeightedGradAccNet(**acc_net.get_params())
    plain_net = WeightedNet(**plain_net.get_params())
    with pytest.warns(LossItemsWarning, match='could not compute the loss'):
        fit_seeded(acc_net, {'data': X}, y)
    fit_seeded(plain_net, {'data': X}, y)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


class ReturnsMore:
    """A user's train_step_single that returns keys of its own."""

    def train_step_single(self, batch, **fit_params):
        step = super().train_step_single(batch, **fit_params)
        confidence = step['y_pred'].max(dim=1).values.mean()  # over the rows
        return dict(step, confidence=confidence, rows=len(batch[1]))


class RecordStepKeys(Callback):
    train_batch_reads = ()  # nor X, y or y_pred

    def initialize(self):
        self.steps_ = []
        return self

    def on_batch_end(self, net, training=False, confidence=None, rows=None,
                     **kwargs):
        if training:
            self.steps_.append((float(confidence.detach()), rows))


class ReturnsMoreGradAccNet(ReturnsMore, GradAccNeuralNetClassifier):
    pass


class ReturnsMoreNet(ReturnsMore, NeuralNetClassifier):
    pass


def test_keys_of_the_users_step_reach_on_batch_end():
    # a float merged as the loss is: the large batch's mean confidence; any
    # other value, the last piece's (203 rows: steps of 4 x 8, then 8 + 3)
    X, y = classification_data(203)
    acc_net, plain_net = make_nets(4, train_split=None,
                                   callbacks=[('keys', RecordStepKeys())])
    acc_net = ReturnsMoreGradAccNet(**acc_net.get_params())
    plain_net = ReturnsMoreNet(**plain_net.get_params())
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    ours, plain = (dict(net.callbacks_)['keys'].steps_
                   for net in (acc_net, plain_net))
    np.testing.assert_allclose([c for c, _ in ours], [c for c, _ in plain],
                               rtol=1e-10)
    assert [rows for _, rows in plain] == ([32] * 6 + [11]) * 3
    assert [rows for _, rows in ours] == ([8] * 6 + [3]) * 3


class MaskedMeanLoss(torch.nn.Module):
    """Cross-entropy averaged over the targets kept (not -100), as a user
    writes it: with none kept, 0 / 0, whose gradient is NaN."""

    def forward(self, y_pred, y_true):
        kept = y_true != -100
        losses = torch.nn.functional.cross_entropy(
            y_pred, y_true.clamp(min=0), reduction='none')
        return (losses * kept).sum() / kept.sum()


class CriterionStep:
    """A user's train_step_single that calls the criterion, not get_loss."""

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        y_pred = self.infer(Xi, **fit_params)
        loss = self.criterion_(y_pred, yi)
        loss.backward()
        return {'loss': loss, 'y_pred': y_pred}

    def count_loss_items(self, batch):
        return int((batch[1] != -100).sum())


class CriterionStepGradAccNet(CriterionStep, GradAccNeuralNet):
    pass


class CriterionStepNet(CriterionStep, NeuralNet):
    pass


def test_a_step_without_get_loss_trains_past_micro_batches_without_items():
    # each step's first micro-batch has every target ignored: the user's
    # loss there is a mean of none, and it adds nothing, as in the large
    # batch; the next ones are weighted by rescaling .grad
    X, y = classification_data(96)
    y[(np.arange(96) % 24) < 8] = -100
    nets = [cls(torch.nn.Linear, module__in_features=10, module__out_features=3,
                module__dtype=torch.float64, criterion=MaskedMeanLoss,
                optimizer__momentum=0.9, lr=0.1, max_epochs=2,
                train_split=None, verbose=0,
                callbacks=[('record_params', RecordParams())], **kwargs)
            for cls, kwargs in [(CriterionStepGradAccNet, {
                'batch_size': 8, 'acc_steps': 3}), (CriterionStepNet, {
                    'batch_size': 24})]]
    acc_net, plain_net = (fit_seeded(net, X, y) for net in nets)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


def test_train_step_single_override_runs_per_micro_batch():
    X, y = classification_data(100)
    net = CountingGradAccNet(MLPClassifier, batch_size=8, acc_steps=4,
                             max_epochs=1, train_split=None, verbose=0)
    net.fit(X, y)
    assert net.calls_ == 13  # ceil(100 / 8) micro-batches
    assert net.history[-1, 'train_batch_count'] == 4  # ceil(13 / 4) steps


def test_lbfgs_closure_reevaluates_the_whole_group(clf_data):
    X, y = clf_data
    acc_net, plain_net = make_nets(
        4, optimizer=torch.optim.LBFGS, optimizer__max_iter=3, lr=0.5,
        max_epochs=2)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert max_param_diff(acc_net, plain_net) < 1e-9
    assert_same_history(acc_net, plain_net, rtol=1e-9)


class RecordsLossTerms:
    """A user's get_loss that records its two terms in the batch's row, as
    skorch's test_change_get_loss does."""

    def get_loss(self, y_pred, y_true, X=None, training=False):
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        penalty = (y_pred[:, 0] ** 2).mean()
        if training:
            self.history.record_batch('nll', loss.item())
            self.history.record_batch('penalty', penalty.detach())
        return loss + penalty


class TermsGradAccNet(RecordsLossTerms, GradAccNeuralNetClassifier):
    pass


class TermsNet(RecordsLossTerms, NeuralNetClassifier):
    pass


@pytest.mark.parametrize('micro_batch_size', [None, 3])
def test_values_recorded_in_get_loss_are_the_large_batch_values(
        clf_data, micro_batch_size):
    # each micro-batch records its own terms; the row gets the group's
    # count-weighted mean, as the loss, which is what the large batch records
    X, y = clf_data
    acc_net, plain_net = make_nets(4)
    acc_net = TermsGradAccNet(
        **{**acc_net.get_params(), 'micro_batch_size': micro_batch_size})
    plain_net = TermsNet(**plain_net.get_params())
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    for key in ['train_loss', 'nll', 'penalty']:
        got = acc_net.history[:, 'batches', :, key]
        expected = plain_net.history[:, 'batches', :, key]
        np.testing.assert_allclose(np.asarray(got, dtype=float),
                                   np.asarray(expected, dtype=float),
                                   rtol=1e-10, err_msg=key)


class ClampsAfterTheStep(NeuralNetClassifier):
    """A user's net whose train_step clamps the parameters after skorch's."""

    def train_step(self, batch, **fit_params):
        step = super().train_step(batch, **fit_params)
        with torch.no_grad():
            for param in self.module_.parameters():
                param.clamp_(-0.05, 0.05)
        return step


def test_a_step_that_grad_acc_would_hide_is_refused_or_runs_per_step(clf_data):
    # after GradAccMixin in the bases, its train_step would never be called
    # (the mixin's replaces it): refused; before, it runs once per step
    class Hidden(GradAccMixin, ClampsAfterTheStep):
        pass

    with pytest.raises(ValueError, match=(
            r"^ClampsAfterTheStep.train_step comes after GradAccMixin in the "
            r"bases of Hidden, which replaces it; put ClampsAfterTheStep before "
            r"GradAccMixin, so that its super\(\).train_step is GradAccMixin's\.$")):
        Hidden(MLPClassifier, acc_steps=4).initialize()

    class Clamped(ClampsAfterTheStep, GradAccMixin, NeuralNetClassifier):
        pass

    acc_net, plain_net = make_nets(4)
    acc_net = Clamped(**acc_net.get_params())
    plain_net = ClampsAfterTheStep(**plain_net.get_params())
    fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
    assert max(param.abs().max() for param in acc_net.module_.parameters()) <= 0.05
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


class TemperatureOfItsOwn:
    """A temperature that initialize_optimizer adds to the optimizer's
    parameters, not one of the net's learnable ones."""

    def initialize_module(self):
        super().initialize_module()
        self.log_t_ = torch.nn.Parameter(torch.zeros((), dtype=DTYPE))
        return self

    def initialize_optimizer(self, *args, **kwargs):
        self.optimizer_ = torch.optim.SGD(
            list(self.module_.parameters()) + [self.log_t_], lr=self.lr)
        return self

    def get_loss(self, y_pred, y_true, *args, **kwargs):
        return torch.nn.functional.nll_loss(
            torch.log_softmax(torch.log(y_pred) * self.log_t_.exp(), dim=-1), y_true)


def test_a_parameter_only_the_optimizer_holds_is_normalized_too(clf_data):
    acc_net, plain_net = make_nets(4)
    acc_net = type('Acc', (TemperatureOfItsOwn, GradAccNeuralNetClassifier), {})(
        **acc_net.get_params())
    plain_net = type('Plain', (TemperatureOfItsOwn, NeuralNetClassifier), {})(
        **plain_net.get_params())
    fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
    assert abs(float(plain_net.log_t_.detach())) > 1e-3  # it trains
    torch.testing.assert_close(acc_net.log_t_, plain_net.log_t_, rtol=0,
                               atol=PARAM_ATOL)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
