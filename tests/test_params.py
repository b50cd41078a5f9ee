"""The ``acc_steps`` hyper-parameter: validation and the sklearn API."""

import pickle

import numpy as np
import pytest
import skorch
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer
from skorch import NeuralNetClassifier

import skorch_gradacc
from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import MLPClassifier, fit_seeded


def make_net(**kwargs):
    kwargs.setdefault('max_epochs', 2)
    kwargs.setdefault('verbose', 0)
    return GradAccNeuralNetClassifier(MLPClassifier, batch_size=8, **kwargs)


class TestValidation:
    @pytest.mark.parametrize('acc_steps', [
        0, -1, 2.0, 1.5, '2', None, True, False, [2]])
    def test_bad_values_raise_before_training(self, clf_data, acc_steps):
        net = make_net(acc_steps=acc_steps)
        msg = ("acc_steps must be a positive integer, got {!r} instead."
               .format(acc_steps))
        with pytest.raises(ValueError) as exc:
            net.fit(*clf_data)
        assert str(exc.value) == msg
        assert not net.initialized_  # raised in initialize, before training

    def test_set_params_after_initialize_is_checked(self, clf_data):
        net = make_net(acc_steps=2).initialize()
        net.set_params(acc_steps=0)
        with pytest.raises(ValueError, match=r"got 0 instead"):
            net.partial_fit(*clf_data)
        assert len(net.history) == 0  # no epoch was started

    @pytest.mark.parametrize('acc_steps', [np.int64(3), np.int32(2), 1, 1000])
    def test_good_values(self, clf_data, acc_steps):
        net = make_net(acc_steps=acc_steps, train_split=None, max_epochs=1)
        net.fit(*clf_data)
        n_micro_batches = int(np.ceil(len(clf_data[0]) / 8))
        assert net.history[-1, 'train_batch_count'] == int(
            np.ceil(n_micro_batches / acc_steps))

    def test_numpy_bools_are_bools(self, clf_data):
        # a grid over np.array([True, False]) gives NumPy bools, which
        # skorch's own bool parameters take
        X, y = clf_data
        search = GridSearchCV(
            make_net(acc_steps=2, train_split=None, max_epochs=1),
            {'skip_nonfinite': np.array([True, False]),
             'check_loss': np.array([False])}, cv=2, error_score='raise')
        search.fit(X, y)
        assert type(search.best_params_['skip_nonfinite']) is np.bool_
        assert len(search.best_estimator_.history) == 1


class TestSklearnApi:
    def test_get_set_params_and_clone(self):
        net = make_net(acc_steps=4)
        assert net.get_params()['acc_steps'] == 4
        net.set_params(acc_steps=2)
        assert clone(net).acc_steps == 2

    def test_clone_of_fitted_net_is_unfitted_with_same_params(self, clf_data):
        net = fit_seeded(make_net(acc_steps=3), *clf_data)
        cloned = clone(net)
        assert cloned.acc_steps == 3
        assert not cloned.initialized_

    def test_pickle_round_trip(self, clf_data):
        X, y = clf_data
        net = fit_seeded(make_net(acc_steps=3), X, y)
        loaded = pickle.loads(pickle.dumps(net))
        assert loaded.acc_steps == 3
        np.testing.assert_array_equal(loaded.predict_proba(X),
                                      net.predict_proba(X))

    def test_pickle_holds_the_module_once(self, clf_data):
        # the engine refers to module_, which skorch pickles apart: a copy
        # of its own would double the pickle and outlive a load
        X, y = clf_data
        kwargs = dict(batch_size=8, max_epochs=2, verbose=0,
                      module__n_hidden=4096)  # 0.4 MB of parameters
        net = GradAccNeuralNetClassifier(MLPClassifier, acc_steps=3, **kwargs)
        fit_seeded(net, X, y)
        plain = fit_seeded(NeuralNetClassifier(MLPClassifier, **kwargs), X, y)
        assert len(pickle.dumps(net)) < 1.1 * len(pickle.dumps(plain))
        loaded = pickle.loads(pickle.dumps(net))
        engine = vars(loaded).get('engine_')
        assert engine is None or engine.module is loaded.module_

    def test_pipeline_and_grid_search(self, clf_data):
        X, y = clf_data
        pipe = Pipeline([
            ('scale', FunctionTransformer(lambda X: X / 2)),
            ('net', make_net(train_split=None)),
        ])
        pipe.set_params(net__acc_steps=2)
        assert pipe.get_params()['net__acc_steps'] == 2
        search = GridSearchCV(
            pipe, {'net__acc_steps': [1, 4], 'net__lr': [0.01, 0.1]},
            cv=2, scoring='accuracy', refit=True)
        torch.manual_seed(0)
        search.fit(X, y)
        # the oracle: the same search over plain skorch's batch_size
        plain_pipe = Pipeline([
            ('scale', FunctionTransformer(lambda X: X / 2)),
            ('net', NeuralNetClassifier(MLPClassifier, max_epochs=2,
                                        verbose=0, train_split=None)),
        ])
        plain = GridSearchCV(
            plain_pipe, {'net__batch_size': [8, 32], 'net__lr': [0.01, 0.1]},
            cv=2, scoring='accuracy', refit=True)
        torch.manual_seed(0)
        plain.fit(X, y)
        np.testing.assert_allclose(search.cv_results_['mean_test_score'],
                                   plain.cv_results_['mean_test_score'],
                                   rtol=1e-12)
        assert search.best_index_ == plain.best_index_
        assert search.best_estimator_['net'].acc_steps == (
            search.best_params_['net__acc_steps'])

    def test_cross_val_score_is_reproducible(self, clf_data):
        X, y = clf_data
        net = make_net(acc_steps=4, train_split=None)
        torch.manual_seed(0)
        first = cross_val_score(net, X, y, cv=3)
        torch.manual_seed(0)
        second = cross_val_score(net, X, y, cv=3)
        np.testing.assert_array_equal(first, second)


class TestSearches:
    @pytest.mark.slow  # joblib's worker processes import torch: seconds
    def test_randomized_search_parallel_over_acc_steps_and_batch_size(
            self, clf_data):
        from sklearn.model_selection import RandomizedSearchCV

        X, y = clf_data
        search = RandomizedSearchCV(
            make_net(train_split=None, max_epochs=1),
            {'acc_steps': [1, 2, 4], 'batch_size': [4, 8]}, n_iter=4, cv=2,
            scoring='accuracy', n_jobs=2, random_state=0)
        search.fit(X, y)
        params = search.cv_results_['params']
        assert len(params) == 4
        assert all(set(p) == {'acc_steps', 'batch_size'} for p in params)
        assert np.isfinite(search.cv_results_['mean_test_score']).all()

    @pytest.mark.slow  # joblib's worker processes import torch: seconds
    def test_parallel_search_matches_serial(self, clf_data):
        # each candidate seeds torch itself, so workers reproduce the
        # serial run exactly
        X, y = clf_data
        grid = {'acc_steps': [1, 4]}
        scores = []
        for n_jobs in (1, 2):
            search = GridSearchCV(SeededNet(MLPClassifier, batch_size=8,
                                            max_epochs=2, verbose=0,
                                            train_split=None),
                                  grid, cv=2, n_jobs=n_jobs)
            search.fit(X, y)
            scores.append(search.cv_results_['mean_test_score'])
        np.testing.assert_array_equal(scores[0], scores[1])

    def test_cross_validate(self, clf_data):
        from sklearn.model_selection import cross_validate

        result = cross_validate(make_net(acc_steps=4, train_split=None), *clf_data,
                                cv=2, scoring=['accuracy', 'neg_log_loss'])
        assert len(result['test_accuracy']) == 2
        assert (result['test_neg_log_loss'] < 0).all()


class SeededNet(GradAccNeuralNetClassifier):
    """Seeds torch at the start of every fit, for reproducible searches."""

    def initialize(self):
        import torch
        torch.manual_seed(0)
        return super().initialize()


@pytest.mark.parametrize('net_cls', [
    skorch_gradacc.GradAccNeuralNet, skorch_gradacc.GradAccNeuralNetClassifier,
    skorch_gradacc.GradAccNeuralNetBinaryClassifier,
    skorch_gradacc.GradAccNeuralNetRegressor])
def test_every_parameter_is_in_the_signature_and_documented(net_cls):
    import inspect

    own = [name for name, param in inspect.signature(
        skorch_gradacc.GradAccMixin.__init__).parameters.items()
        if param.kind == param.KEYWORD_ONLY]
    assert own == ['acc_steps', 'micro_batch_size', 'skip_nonfinite',
                   'mixed_precision', 'check_loss', 'memory_budget']
    signature = inspect.signature(net_cls).parameters
    for name in own:
        assert signature[name].default == inspect.signature(
            skorch_gradacc.GradAccMixin.__init__).parameters[name].default
        assert '\n    {} : '.format(name) in net_cls.__doc__, name


class UndeclaredReader(skorch.callbacks.Callback):
    def on_batch_end(self, net, **kwargs):
        pass


def test_a_fit_in_groups_leaves_no_state_in_get_params(clf_data):
    # runtime state ends in '_', or clone() would pass it to __init__
    net = make_net(acc_steps=2, micro_batch_size=3, skip_nonfinite=True,
                   callbacks=[('reader', UndeclaredReader())])
    before = set(net.get_params(deep=False))
    with pytest.warns(UserWarning, match='train_batch_reads'):
        net.fit(*clf_data)
    assert set(net.get_params(deep=False)) == before
    assert clone(net).get_params(deep=False).keys() == before


@pytest.mark.parametrize('check', [
    'check_parameters_default_constructible',
    'check_do_not_raise_errors_in_init_or_set_params'])
def test_the_generated_signature_is_what_sklearn_checks_read(check):
    # without GradAccMixin.__init_subclass__, the signature is the mixin's
    # (*args, acc_steps=1, ..., **kwargs), and these checks fail
    from sklearn.utils import estimator_checks

    if not hasattr(estimator_checks,
                   'check_do_not_raise_errors_in_init_or_set_params'):
        # scikit-learn before 1.6: the checks build the class without module
        pytest.skip('these checks take an instance from scikit-learn 1.6 on')
    getattr(estimator_checks, check)('net', make_net(acc_steps=2))
