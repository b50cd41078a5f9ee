"""skorch features behave on an accumulating net as on the large-batch net."""

import copy
import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from skorch import NeuralNetClassifier
from skorch.callbacks import (
    BatchScoring,
    Checkpoint,
    EarlyStopping,
    EpochScoring,
    Freezer,
    LoadInitState,
    LRScheduler,
    ParamMapper,
    PrintLog,
    ProgressBar,
    TrainEndCheckpoint,
    Unfreezer,
    WarmRestartLR,
)
from skorch.utils import params_for

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import (
    PARAM_ATOL,
    MLPClassifier,
    assert_same_history,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
)


def assert_equivalent(acc_net, plain_net):
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


class TestLRSchedulers:
    @pytest.mark.parametrize('policy, kwargs', [
        (torch.optim.lr_scheduler.StepLR, dict(step_size=1, gamma=0.5)),
        (torch.optim.lr_scheduler.ExponentialLR, dict(gamma=0.7)),
        (torch.optim.lr_scheduler.ReduceLROnPlateau,
         dict(patience=0, factor=0.3, monitor='valid_loss')),
        (WarmRestartLR, dict(min_lr=1e-3, max_lr=0.2, base_period=2)),
    ])
    def test_per_epoch(self, clf_data, policy, kwargs):
        scheduler = LRScheduler(policy, event_name='event_lr', **kwargs)
        acc_net, plain_net = fit_pair(
            4, *clf_data, max_epochs=5, callbacks=[('lr', scheduler)])
        assert_equivalent(acc_net, plain_net)
        assert acc_net.history[:, 'event_lr'] == plain_net.history[
            :, 'event_lr']

    def test_warm_restart_per_batch(self, clf_data):
        scheduler = LRScheduler(WarmRestartLR, min_lr=1e-3, max_lr=0.2,
                                base_period=3, step_every='batch')
        acc_net, plain_net = fit_pair(4, *clf_data,
                                      callbacks=[('lr', scheduler)])
        assert_equivalent(acc_net, plain_net)


class TestTrainingControl:
    def test_early_stopping(self, clf_data):
        stopper = EarlyStopping(monitor='valid_loss', patience=1,
                                threshold=0.01)
        acc_net, plain_net = fit_pair(
            4, *clf_data, max_epochs=30, lr=0.5, callbacks=[('es', stopper)])
        assert len(acc_net.history) < 30  # it did stop early
        assert_equivalent(acc_net, plain_net)

    def test_freezer_and_unfreezer(self, clf_data):
        callbacks = [('freeze', Freezer('hidden.*')),
                     ('unfreeze', Unfreezer('hidden.*', at=3))]
        acc_net, plain_net = fit_pair(4, *clf_data, max_epochs=4,
                                      callbacks=callbacks)
        assert_equivalent(acc_net, plain_net)
        first = acc_net.callbacks_[1][1]
        assert first is not None

    def test_param_mapper(self, clf_data):
        scale = ParamMapper('output.weight', schedule=lambda net: (
            lambda p: p.requires_grad_(len(net.history) % 2 == 1)))
        acc_net, plain_net = fit_pair(4, *clf_data, max_epochs=4,
                                      callbacks=[('mapper', scale)])
        assert_equivalent(acc_net, plain_net)


class TestScoringAndLogging:
    def test_scoring_on_train_and_valid(self, clf_data):
        callbacks = [
            ('train_acc', EpochScoring('accuracy', on_train=True,
                                       name='train_acc')),
            ('valid_f1', EpochScoring('f1_macro', name='valid_f1')),
            ('train_bacc', BatchScoring('accuracy', on_train=True,
                                        name='train_bacc')),
            ('valid_bacc', BatchScoring('accuracy', name='valid_bacc')),
        ]
        acc_net, plain_net = fit_pair(4, *clf_data, callbacks=callbacks)
        assert_equivalent(acc_net, plain_net)
        for key in ['train_acc', 'valid_f1', 'train_bacc']:
            np.testing.assert_allclose(acc_net.history[:, key],
                                       plain_net.history[:, key], rtol=1e-10)

    def test_print_log_output(self, clf_data):
        lines = {}
        for which in ['acc', 'plain']:
            sink = []
            print_log = PrintLog(sink=sink.append, keys_ignored=['dur'])
            acc_net, plain_net = make_nets(4, callbacks=[])
            net = acc_net if which == 'acc' else plain_net
            net.set_params(callbacks__print_log=print_log, verbose=1)
            fit_seeded(net, *clf_data)
            lines[which] = sink
        assert lines['acc'] == lines['plain']
        assert len(lines['acc']) == 2 + 3  # header, rule, one row per epoch

    def test_progress_bar_length_and_counts(self, clf_data):
        results = []
        for net in make_nets(4, callbacks=[
                ('progress', ProgressBar(postfix_keys=['train_loss']))]):
            bar = dict(net.callbacks)['progress']
            fit_seeded(net, *clf_data)
            # the user's bar itself counts the steps: nothing replaced it
            assert dict(net.callbacks_)['progress'] is bar
            results.append((bar.pbar_.total, bar.pbar_.n))
        acc, plain = results
        # 162 train samples in groups of 32: 6 steps; 41 valid samples
        # in batches of 8 (acc) or 32 (plain)
        assert acc == (6 + 6, 6 + 6)
        assert plain == (6 + 2, 6 + 2)
        assert acc[0] == acc[1]  # the bar is filled exactly

    def test_progress_bar_shows_the_steps_from_the_start(self, clf_data, capsys):
        # skorch draws the bar with the micro-batches' total (21 + 6); the
        # net draws it again with the steps' before the first one
        acc_net, _ = make_nets(4, max_epochs=1, callbacks=[
            ('progress', ProgressBar())])
        fit_seeded(acc_net, *clf_data)
        draws = [draw for draw in capsys.readouterr().err.split('\r')
                 if '/' in draw]
        assert '| 0/27 ' in draws[0]
        assert '| 0/12 ' in draws[1]

    def test_progress_bar_with_its_own_validation_batch_size(self, clf_data):
        # the training micro-batches are counted at the training batch size
        results = []
        for net in make_nets(4, iterator_valid__batch_size=5, callbacks=[
                ('progress', ProgressBar())]):
            fit_seeded(net, *clf_data)
            bar = dict(net.callbacks_)['progress']
            results.append((bar.pbar_.total, bar.pbar_.n))
        # 162 train samples in groups of 32: 6 steps; 41 valid samples
        # in batches of 5: 9
        assert results[0] == results[1] == (6 + 9, 6 + 9)

    def test_user_progress_bar_is_left_alone(self):
        bar = ProgressBar()
        net = GradAccNeuralNetClassifier(MLPClassifier, acc_steps=2,
                                         callbacks=[bar]).initialize()
        assert type(bar) is ProgressBar
        assert net.callbacks == [bar]
        assert type(clone(net).callbacks[0]) is ProgressBar


class TestCheckpoints:
    def test_resume_after_interruption_equals_uninterrupted(self, clf_data,
                                                             tmp_path):
        X, y = clf_data
        whole, _ = make_nets(4, max_epochs=4, optimizer__momentum=0.9)
        fit_seeded(whole, X, y)

        checkpoint = Checkpoint(monitor=None, dirname=str(tmp_path))
        first, _ = make_nets(4, max_epochs=2, optimizer__momentum=0.9,
                             callbacks=[('cp', checkpoint)])
        fit_seeded(first, X, y)

        resumed, _ = make_nets(4, max_epochs=2, optimizer__momentum=0.9,
                               callbacks=[('load', LoadInitState(
                                   Checkpoint(monitor=None,
                                              dirname=str(tmp_path))))])
        resumed.fit(X, y)  # no shuffling: the order does not depend on seeds
        assert len(resumed.history) == 4
        for key, value in resumed.module_.state_dict().items():
            torch.testing.assert_close(value, whole.module_.state_dict()[key],
                                       rtol=0, atol=PARAM_ATOL)

    def test_train_end_checkpoint(self, clf_data, tmp_path):
        X, y = clf_data
        net, _ = make_nets(4, callbacks=[('end', TrainEndCheckpoint(
            dirname=str(tmp_path)))])
        fit_seeded(net, X, y)
        loaded = GradAccNeuralNetClassifier(MLPClassifier, acc_steps=4)
        loaded.initialize().load_params(checkpoint=dict(net.callbacks_)[
            'end'].checkpoint_)
        for key, value in loaded.module_.state_dict().items():
            assert torch.equal(value, net.module_.state_dict()[key])


class TestRepeatedFits:
    def test_partial_fit_continues_like_large_batch(self, clf_data):
        acc_net, plain_net = make_nets(4, max_epochs=2, train_split=None)
        for net in (acc_net, plain_net):
            torch.manual_seed(0)
            net.fit(*clf_data)
            net.partial_fit(*clf_data, epochs=1)
            net.partial_fit(*clf_data)
        assert len(acc_net.history) == 5
        assert_equivalent(acc_net, plain_net)

    def test_warm_start_and_max_epochs_change(self, clf_data):
        acc_net, plain_net = make_nets(4, max_epochs=2, warm_start=True)
        for net in (acc_net, plain_net):
            torch.manual_seed(0)
            net.fit(*clf_data)
            net.set_params(max_epochs=1)
            net.fit(*clf_data)
        assert len(acc_net.history) == 3
        assert_equivalent(acc_net, plain_net)

    def test_fit_after_fit_reinitializes(self, clf_data):
        acc_net, plain_net = make_nets(4)
        for net in (acc_net, plain_net):
            fit_seeded(net, *clf_data)
            fit_seeded(net, *clf_data)
        assert len(acc_net.history) == 3
        assert_equivalent(acc_net, plain_net)

    @pytest.mark.parametrize('param, value, plain_value', [
        ('acc_steps', 2, 16), ('batch_size', 4, 16)])
    def test_set_params_between_fits(self, clf_data, param, value,
                                     plain_value):
        # the second partial_fit uses the new value from its first group
        acc_net, plain_net = make_nets(4, max_epochs=1, warm_start=True)
        for net in (acc_net, plain_net):
            torch.manual_seed(0)
            net.fit(*clf_data)
        acc_net.set_params(**{param: value})
        plain_net.set_params(batch_size=plain_value)
        for net in (acc_net, plain_net):
            net.partial_fit(*clf_data)
        assert_equivalent(acc_net, plain_net)
        assert acc_net.history[-1, 'batches', 0, 'train_batch_size'] == 16


class TwoOptimizerMixin:
    """Two optimizers, one per layer, and two criteria summed."""

    def initialize_criterion(self):
        super().initialize_criterion()
        self.criterion2_ = torch.nn.MSELoss()
        return self

    def initialize_optimizer(self, *args, **kwargs):
        named = dict(self.module_.named_parameters())
        self.optimizer_ = torch.optim.SGD(
            [named['hidden.weight'], named['hidden.bias']], lr=0.1,
            momentum=0.9)
        self.optimizer2_ = torch.optim.Adam(
            [named['output.weight'], named['output.bias']], lr=0.01)
        return self

    def get_loss(self, y_pred, y_true, X=None, training=False):
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        ones = torch.ones(len(y_pred), dtype=y_pred.dtype)
        return loss + self.criterion2_(y_pred.sum(1), ones)


class TwoOptimizerNet(TwoOptimizerMixin, GradAccNeuralNetClassifier):
    pass


class TwoOptimizerPlainNet(TwoOptimizerMixin, NeuralNetClassifier):
    pass


def test_several_optimizers_and_criteria(clf_data):
    acc_net, plain_net = make_nets(4)
    acc_net = TwoOptimizerNet(**acc_net.get_params())
    plain_params = plain_net.get_params()
    plain_net = TwoOptimizerPlainNet(**plain_params)
    fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
    assert set(acc_net._optimizers) == {'optimizer', 'optimizer2'}
    assert_equivalent(acc_net, plain_net)
    for name in ['optimizer_', 'optimizer2_']:
        state_acc = getattr(acc_net, name).state_dict()['state']
        state_plain = getattr(plain_net, name).state_dict()['state']
        for index in state_acc:
            for key, value in state_acc[index].items():
                torch.testing.assert_close(value, state_plain[index][key],
                                           rtol=0, atol=PARAM_ATOL)


class TestPersistence:
    @pytest.mark.parametrize('how', ['pickle', 'deepcopy', 'save_params'])
    def test_round_trip_keeps_training_exactly(self, clf_data, tmp_path, how):
        X, y = clf_data
        acc_net, plain_net = make_nets(4, max_epochs=2, train_split=None,
                                       optimizer=torch.optim.Adam, lr=0.01)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        if how == 'pickle':
            restored = pickle.loads(pickle.dumps(acc_net))
        elif how == 'deepcopy':
            restored = copy.deepcopy(acc_net)
        else:
            acc_net.save_params(
                f_params=tmp_path / 'p.pt', f_optimizer=tmp_path / 'o.pt',
                f_history=tmp_path / 'h.json')
            restored = GradAccNeuralNetClassifier(**acc_net.get_params())
            restored.initialize().load_params(
                f_params=tmp_path / 'p.pt', f_optimizer=tmp_path / 'o.pt',
                f_history=tmp_path / 'h.json')
        torch.manual_seed(1), restored.partial_fit(X, y)
        torch.manual_seed(1), plain_net.partial_fit(X, y)
        assert len(restored.history) == 4
        for key, value in restored.module_.state_dict().items():
            torch.testing.assert_close(
                value, plain_net.module_.state_dict()[key], rtol=0,
                atol=PARAM_ATOL)
        assert_same_history(restored, plain_net)

    def test_clone_of_fitted_net(self, clf_data):
        acc_net, plain_net = make_nets(4)
        fit_seeded(acc_net, *clf_data)
        cloned = clone(acc_net)
        assert params_for('callbacks', cloned.get_params()) is not None
        assert cloned.acc_steps == 4 and not cloned.initialized_
        fit_seeded(cloned, *clf_data), fit_seeded(plain_net, *clf_data)
        assert_equivalent(cloned, plain_net)


class TestLoggersAndHelpers:
    """skorch's loggers read only the history; SkorchDoctor records per
    micro-batch (docs/compatibility.rst says how to read it)."""

    @staticmethod
    def loggers():
        from unittest.mock import MagicMock

        from skorch.callbacks import (
            InputShapeSetter,
            MlflowLogger,
            NeptuneLogger,
            SacredLogger,
            TensorBoard,
            WandbLogger,
        )

        return [
            ('tensorboard', TensorBoard(MagicMock())),
            ('wandb', WandbLogger(MagicMock(), save_model=False)),
            ('mlflow', MlflowLogger(MagicMock(), MagicMock(),
                                    create_artifact=False,
                                    log_on_batch_end=True)),
            ('neptune', NeptuneLogger(MagicMock(), log_on_batch_end=True)),
            ('sacred', SacredLogger(MagicMock(), log_on_batch_end=True)),
            ('shape', InputShapeSetter('n_in')),
        ]

    def test_loggers_keep_nothing_and_log_the_large_batch_rows(
            self, clf_data):
        import warnings

        X, y = clf_data
        acc_net, _ = make_nets(4, callbacks=self.loggers())
        assert acc_net.initialize().get_train_outputs_needed() == {
            'batch': False, 'X': False, 'y': False, 'y_pred': False,
            'at_begin': False}
        # neptune's logger imports neptune at the end of training
        loggers = [cb for cb in self.loggers() if cb[0] != 'neptune']
        acc_net, plain_net = make_nets(4, max_epochs=2, callbacks=loggers)
        with warnings.catch_warnings():
            warnings.simplefilter('error')  # no undeclared-reads warning
            fit_seeded(acc_net, X, y)
        fit_seeded(plain_net, X, y)
        assert_equivalent(acc_net, plain_net)

        def batch_logs(net):
            sacred = dict(net.callbacks_)['sacred'].experiment
            return [call.args for call in sacred.log_scalar.call_args_list
                    if call.args[0] == 'train_loss_batch']

        logged, expected = batch_logs(acc_net), batch_logs(plain_net)
        assert len(logged) == len(expected) == 2 * 6  # one per step
        np.testing.assert_allclose([value for _, value in logged],
                                   [value for _, value in expected],
                                   rtol=1e-10)

    def test_skorch_doctor_records_each_micro_batch(self):
        from skorch.helper import SkorchDoctor

        from conftest import classification_data

        X, y = classification_data(160)  # 10 steps of 2 micro-batches of 8

        def doctor(net_cls, **kwargs):
            torch.manual_seed(0)
            net = net_cls(MLPClassifier, max_epochs=1, lr=0.1,
                          train_split=None, verbose=0, **kwargs)
            return SkorchDoctor(net).fit(X, y)

        acc = doctor(GradAccNeuralNetClassifier, batch_size=8, acc_steps=2)
        large = doctor(NeuralNetClassifier, batch_size=16)
        assert (acc.num_steps_, large.num_steps_) == (20, 10)
        for recs in ('activation_recs_', 'gradient_recs_',
                     'param_update_recs_'):
            assert len(getattr(acc, recs)['module']) == 20
            assert len(getattr(large, recs)['module']) == 10
        # records 2i and 2i+1 are step i's micro-batches: their activations
        # are the step's rows, their mean gradient (weighted by count) the
        # step's gradient
        for step in range(10):
            first, second = (acc.activation_recs_['module'][2 * step + j]
                             for j in range(2))
            for layer, value in large.activation_recs_['module'][step].items():
                np.testing.assert_allclose(
                    np.concatenate([first[layer], second[layer]]), value,
                    rtol=0, atol=1e-12)
            first, second = (acc.gradient_recs_['module'][2 * step + j]
                             for j in range(2))
            for param, value in large.gradient_recs_['module'][step].items():
                np.testing.assert_allclose(
                    (first[param] + second[param]) / 2, value, rtol=0,
                    atol=1e-12)
        assert len(acc.net.history[-1, 'batches']) == 10  # rows per step
