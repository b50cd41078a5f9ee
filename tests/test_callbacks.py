"""Invariant 3: callbacks see one batch per optimizer step, with the whole,
normalized gradient, and so behave as on the large-batch net."""

import re
import warnings
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import (
    BatchScoring,
    Callback,
    EpochScoring,
    GradientNormClipping,
    LRScheduler,
    ProgressBar,
)

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import (
    PARAM_ATOL,
    assert_same_history,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
)


class RecordSteps(Callback):
    """Record each training batch's size, gradient, and what it was given.

    It declares nothing, so it gets what the large-batch net passes."""

    def initialize(self):
        self.batch_begin_sizes_ = []
        self.batch_end_ = []
        self.grads_ = []
        return self

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        if training:
            self.batch_begin_sizes_.append(len(batch[0]))

    def on_grad_computed(self, net, named_parameters, batch=None,
                         training=False, **kwargs):
        self.grads_.append(torch.cat(
            [param.grad.flatten().clone() for _, param in named_parameters]))

    def on_batch_end(self, net, batch=None, training=False, **kwargs):
        if training:
            self.batch_end_.append(
                (len(batch[0]), kwargs['loss'], kwargs['y_pred']))


@pytest.fixture
def recorded_pair(clf_data):
    X, y = clf_data
    acc_net, plain_net = fit_pair(
        4, X, y, callbacks=[('record_steps', RecordSteps())])
    return (dict(acc_net.callbacks_)['record_steps'],
            dict(plain_net.callbacks_)['record_steps'])


class TestCallbackCalls:
    def test_batch_begin_and_end_once_per_step(self, recorded_pair):
        acc, plain = recorded_pair
        # 162 training samples a epoch, groups of 32: 6 steps, the last of 2
        assert acc.batch_begin_sizes_ == plain.batch_begin_sizes_
        assert acc.batch_begin_sizes_[:6] == [32, 32, 32, 32, 32, 2]
        assert [size for size, _, _ in acc.batch_end_] == acc.batch_begin_sizes_

    def test_grad_computed_once_per_step_with_whole_gradient(self, recorded_pair):
        acc, plain = recorded_pair
        assert len(acc.grads_) == len(plain.grads_) == 18
        for grad_acc, grad_plain in zip(acc.grads_, plain.grads_):
            torch.testing.assert_close(grad_acc, grad_plain, rtol=0, atol=1e-12)

    def test_batch_end_gets_group_loss_and_predictions(self, recorded_pair):
        acc, plain = recorded_pair
        for (_, loss_acc, y_acc), (_, loss_plain, y_plain) in zip(
                acc.batch_end_, plain.batch_end_):
            torch.testing.assert_close(
                loss_acc, loss_plain.detach(), rtol=1e-12, atol=0)
            torch.testing.assert_close(y_acc, y_plain.detach(), rtol=1e-10,
                                       atol=1e-12)

    def test_batch_end_gets_tensors_without_graphs(self, recorded_pair):
        acc, plain = recorded_pair
        full_groups = [step for step in acc.batch_end_ if step[0] == 32]
        assert full_groups
        for _, loss, y_pred in full_groups:
            # the loss requires grad, as plain skorch's, with no graph kept
            assert loss.requires_grad and loss.grad_fn is None
            assert y_pred.grad_fn is None
        assert all(loss.requires_grad for _, loss, _ in plain.batch_end_)


SCHEDULERS = {
    'step': dict(policy=torch.optim.lr_scheduler.StepLR, step_size=2,
                 gamma=0.5),
    'one-cycle': dict(policy=torch.optim.lr_scheduler.OneCycleLR,
                      max_lr=0.5, total_steps=18),
    'cyclic': dict(policy=torch.optim.lr_scheduler.CyclicLR, base_lr=0.01,
                   max_lr=0.5, step_size_up=4),
}


class TestCallbacksBehaveAsOnLargeBatchNet:
    @pytest.mark.parametrize('name', sorted(SCHEDULERS))
    def test_lr_scheduler_per_batch(self, clf_data, name):
        X, y = clf_data
        scheduler = LRScheduler(
            step_every='batch', event_name='event_lr', **SCHEDULERS[name])
        acc_net, plain_net = fit_pair(
            4, X, y, optimizer__momentum=0.9,
            callbacks=[('scheduler', scheduler)])
        lrs = [row['event_lr'] for row in acc_net.history[-1, 'batches']
               if 'event_lr' in row]
        assert len(lrs) == 6  # one per step, not one per micro-batch
        assert len(set(lrs)) > 1
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)
        assert (acc_net.history[:, 'batches', :, 'event_lr']
                == plain_net.history[:, 'batches', :, 'event_lr'])

    def test_gradient_norm_clipping(self, clf_data):
        X, y = clf_data
        clipping = GradientNormClipping(gradient_clip_value=0.05)
        acc_net, plain_net = fit_pair(4, X, y, callbacks=[('clip', clipping)])
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        unclipped, _ = fit_pair(4, X, y)
        # clipping took effect: without it the parameters differ
        assert max_param_diff(acc_net, unclipped) > 1e-3

    def test_train_scoring(self, clf_data):
        X, y = clf_data
        callbacks = [
            ('train_acc', EpochScoring(
                'accuracy', on_train=True, name='train_acc',
                lower_is_better=False)),
            ('train_batch_acc', BatchScoring('accuracy', on_train=True,
                                       name='train_batch_acc')),
            ('valid_batch_acc', BatchScoring('accuracy', name='valid_batch_acc')),
        ]
        acc_net, plain_net = fit_pair(4, X, y, callbacks=callbacks)
        assert_same_history(acc_net, plain_net)
        np.testing.assert_allclose(
            acc_net.history[:, 'train_batch_acc'],
            plain_net.history[:, 'train_batch_acc'], rtol=1e-10)
        assert acc_net.history[:, 'train_acc'] == plain_net.history[
            :, 'train_acc']

    @pytest.mark.parametrize('net_caching', ['auto', True, False])
    @pytest.mark.parametrize('cb_caching', [True, False])
    def test_epoch_scoring_on_train_alone(self, clf_data, net_caching,
                                          cb_caching):
        # skorch's standard way to log training accuracy, with no other
        # callback that keeps the batch; the net's use_caching wins
        X, y = clf_data
        scoring = EpochScoring('accuracy', on_train=True, name='train_acc',
                               use_caching=cb_caching)
        acc_net, plain_net = fit_pair(4, X, y, use_caching=net_caching,
                                      callbacks=[('train_acc', scoring)])
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)
        assert acc_net.history[:, 'train_acc'] == plain_net.history[
            :, 'train_acc']


class TestUserObjectsAreKept:
    def test_callbacks_are_the_users_objects(self, clf_data):
        X, y = clf_data
        scheduler = LRScheduler('StepLR', step_size=1, step_every='batch')
        bar = ProgressBar()
        acc_net, _ = make_nets(4, max_epochs=1, callbacks=[
            ('sched', scheduler), ('bar', bar)])
        fit_seeded(acc_net, X, y)
        callbacks = dict(acc_net.callbacks_)
        assert callbacks['sched'] is scheduler and callbacks['bar'] is bar
        assert scheduler.lr_scheduler_ is not None
        assert scheduler.batch_idx_ == 6  # one per optimizer step
        # set_params reaches the object the net uses
        acc_net.set_params(callbacks__sched__step_size=456)
        assert dict(acc_net.callbacks_)['sched'].step_size == 456

    def test_mock_callback(self, clf_data):
        X, y = clf_data
        mock = Mock()
        acc_net, _ = make_nets(4, max_epochs=1, callbacks=[('mock', mock)])
        fit_seeded(acc_net, X, y)
        # 6 steps; 41 validation rows in batches of 8
        assert mock.on_batch_end.call_count == 6 + 6


class TestBatchReads:
    class Declared(Callback):
        train_batch_reads = ('y_pred',)

        def on_batch_end(self, net, y_pred=None, training=False, **kwargs):
            if training:
                self.rows_ = getattr(self, 'rows_', 0) + len(y_pred)

    class Undeclared(Callback):
        def on_batch_end(self, net, y_pred=None, training=False, **kwargs):
            pass

    @pytest.mark.parametrize('callbacks, expected', [
        ([], {'batch': False, 'X': False, 'y': False, 'y_pred': False}),
        ([Declared()], {'batch': False, 'X': False, 'y': False, 'y_pred': True}),
        ([Undeclared()], {'batch': True, 'X': True, 'y': True, 'y_pred': True}),
        ([Mock()], {'batch': False, 'X': False, 'y': False, 'y_pred': False}),
        ([ProgressBar(), LRScheduler('StepLR', step_size=1,
                                     step_every='batch')],
         {'batch': False, 'X': False, 'y': False, 'y_pred': False}),
    ])
    @pytest.mark.filterwarnings('ignore:.*does not declare what it reads')
    def test_what_is_kept(self, callbacks, expected):
        acc_net, _ = make_nets(4, callbacks=callbacks)
        needed = acc_net.initialize().get_train_outputs_needed()
        assert needed == dict(expected, at_begin=False)  # none reads at the begin

    class TargetsAtBegin(Callback):
        """Reads the targets before the group is trained on."""
        train_batch_reads = ('y',)

        def initialize(self):
            self.targets_ = []
            return self

        def on_batch_begin(self, net, batch=None, training=False, **kwargs):
            if training:
                _, y = batch
                self.targets_.append(np.asarray(y).tolist())

    def test_targets_read_in_batch_begin_are_the_large_batchs(self, clf_data):
        acc_net, plain_net = fit_pair(
            4, *clf_data, callbacks=[('targets', self.TargetsAtBegin())])
        acc, plain = (dict(net.callbacks_)['targets'].targets_
                      for net in (acc_net, plain_net))
        assert len(acc) == 3 * 6  # 162 training rows in groups of 32
        assert acc == plain

    def test_undeclared_callback_is_warned_about_once(self, clf_data):
        X, y = clf_data
        acc_net, _ = make_nets(4, max_epochs=3, callbacks=[
            ('shapes', self.Undeclared()), ('declared', self.Declared()),
            ('scoring', EpochScoring('accuracy', on_train=True)),
            ('bar', ProgressBar())])
        with pytest.warns(UserWarning) as record:
            fit_seeded(acc_net, X, y)
            fit_seeded(acc_net, X, y)  # a second fit: no second warning
        messages = [str(w.message) for w in record
                    if 'train_batch_reads' in str(w.message)]
        assert messages == [
            "GradAccNeuralNetClassifier keeps whole training groups for "
            "callback 'shapes' (Undeclared): it overrides on_batch_end "
            "without declaring what it reads, so memory grows with acc_steps. "
            "Declare it in its class: train_batch_reads = () for nothing, or "
            "e.g. ('y_pred',)."]
        # it points at the user's call to fit, in conftest's fit_seeded
        [warned] = [w for w in record if 'train_batch_reads' in str(w.message)]
        assert warned.filename.endswith('conftest.py')

    @pytest.mark.parametrize('acc_steps', [1, 4])
    def test_no_warning_without_undeclared_callbacks(self, clf_data,
                                                     acc_steps):
        X, y = clf_data
        acc_net, _ = make_nets(acc_steps, max_epochs=1, callbacks=[
            self.Declared(), BatchScoring('accuracy', on_train=True),
            LRScheduler('StepLR', step_size=1, step_every='batch'), Mock()])
        if acc_steps == 1:  # plain skorch's loop keeps nothing more
            acc_net.set_params(callbacks__Declared=self.Undeclared())
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            fit_seeded(acc_net, X, y)

    @pytest.mark.parametrize('declared', ['y_pred', 5, ('X', 'loss')])
    def test_bad_declaration_raises_before_training(self, declared):
        # a string, not a collection; no collection; what is not readable
        Bad = type('Bad', (Callback,), {'train_batch_reads': declared})
        acc_net, _ = make_nets(4, callbacks=[('bad', Bad())])
        with pytest.raises(ValueError, match=re.escape(
                "Bad.train_batch_reads must be a collection of 'X', 'y' and "
                "'y_pred', e.g. ('y_pred',) or (), got {!r} instead.".format(
                    declared))):
            acc_net.initialize()


    class CountsHits:
        """A net's own on_batch_end that scores the training batch."""

        def on_batch_end(self, net, batch=None, y_pred=None, training=False,
                         **kwargs):
            super().on_batch_end(net, batch=batch, y_pred=y_pred,
                                 training=training, **kwargs)
            if training:
                hits = (y_pred.argmax(1) == batch[1]).sum()
                self.history.record_batch('hits', int(hits))

    def test_a_nets_own_batch_method_reads_as_a_callback(self, clf_data):
        # skorch's notify calls the net's own on_batch_end with the batch
        acc_net, plain_net = make_nets(4)
        Acc = type('Acc', (self.CountsHits, GradAccNeuralNetClassifier), {})
        Plain = type('Plain', (self.CountsHits, NeuralNetClassifier), {})
        acc_net = Acc(**acc_net.get_params())
        plain_net = Plain(**plain_net.get_params())
        with pytest.warns(UserWarning, match='training groups for its own '
                          'methods: it overrides on_batch_end'):
            fit_seeded(acc_net, *clf_data)
        fit_seeded(plain_net, *clf_data)
        assert acc_net.history[:, 'batches', :, 'hits'] == plain_net.history[
            :, 'batches', :, 'hits']
        Declared = type('Declared', (Acc,), {'train_batch_reads': ('y', 'y_pred')})
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            declared = fit_seeded(Declared(**acc_net.get_params()), *clf_data)
        assert declared.history[:, 'batches', :, 'hits'] == plain_net.history[
            :, 'batches', :, 'hits']
        Bad = type('Bad', (Acc,), {'train_batch_reads': 'y_pred'})
        with pytest.raises(ValueError, match="Bad.train_batch_reads must be"):
            Bad(**acc_net.get_params()).initialize()


class HalvesInputs(Callback):
    """An augmentation in place, in on_batch_begin."""

    train_batch_reads = ('X',)

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        if training:
            batch[0].mul_(0.5)


@pytest.mark.parametrize('micro_batch_size', [None, 'auto'])
def test_a_batch_changed_in_place_in_on_batch_begin_trains_changed(
        clf_data, micro_batch_size):
    # plain skorch trains on the batch the callbacks got: the micro-batches
    # are its rows
    acc_net, plain_net = make_nets(4, iterator_train__shuffle=True,
                                   callbacks=[('halves', HalvesInputs())])
    acc_net.set_params(micro_batch_size=micro_batch_size)
    fit_seeded(acc_net, *clf_data)
    fit_seeded(plain_net, *clf_data)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net, ignore=['micro_batch_size'])


class SAM(torch.optim.SGD):
    """A sharpness-aware step: the closure is evaluated twice, at the
    parameters and at a point perturbed along the gradient."""

    def step(self, closure):
        closure()
        params = [p for group in self.param_groups for p in group['params']
                  if p.grad is not None]
        eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in params]
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.add_(e)
        closure()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        return super().step()


def test_optimizer_evaluating_the_closure_twice_equals_large_batch(clf_data):
    X, y = clf_data
    acc_net, plain_net = fit_pair(4, X, y, optimizer=SAM, max_epochs=2)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


class RenamedCriterionNet(GradAccNeuralNetClassifier):
    """A criterion registered under another name, summing its loss."""

    def initialize_criterion(self):
        self.my_criterion_ = torch.nn.NLLLoss(reduction='sum')
        return self

    def get_loss(self, y_pred, y_true, X=None, training=False):
        return self.my_criterion_(torch.log(y_pred), y_true)


class RenamedCriterionPlainNet(NeuralNetClassifier):
    initialize_criterion = RenamedCriterionNet.initialize_criterion
    get_loss = RenamedCriterionNet.get_loss


def test_criterion_under_another_name_is_counted(clf_data):
    # reduction='sum' under the name my_criterion: summed, not averaged
    X, y = clf_data
    acc_net, plain_net = make_nets(4, lr=0.002)
    acc_net = RenamedCriterionNet(**acc_net.get_params())
    plain_net = RenamedCriterionPlainNet(**plain_net.get_params())
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert acc_net.count_loss_items((torch.zeros(3, 10), None)) is None
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL


def test_memory_page_gives_the_warnings_words():
    from pathlib import Path

    from skorch_gradacc.callbacks import UNDECLARED_READS_MESSAGE

    page = Path(__file__).parent.parent / 'docs' / 'memory_and_robustness.rst'
    text = ' '.join(page.read_text().split())
    assert UNDECLARED_READS_MESSAGE.format(
        net='MyNet', reader="callback 'log' (LogShapes)",
        methods='on_batch_end') in text
