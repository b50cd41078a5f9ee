"""Hyper-parameter search and pickling on a real ``dask.distributed`` cluster.

A :class:`distributed.LocalCluster` with two worker processes (on localhost
only, no dashboard) runs scikit-learn's searches through joblib's Dask
backend. The scores must be exactly those of the same search run serially in
this process, and a GradAcc net must survive the trip to a worker and back.

The nets and modules the workers unpickle are in ``tests/dask_helpers.py``,
which is uploaded to the workers, since a worker cannot import this file.
One cluster serves the whole module; it is closed even when a test fails.
"""

import logging
import os
from pathlib import Path

import dask_helpers
import joblib
import numpy as np
import pytest
import torch
from scipy.stats import loguniform
from sklearn.model_selection import GridSearchCV, RandomizedSearchCV

distributed = pytest.importorskip('distributed')

HELPERS = Path(dask_helpers.__file__).resolve()

# a hang (a lost worker, a dead scheduler) fails the test, it does not block
pytestmark = pytest.mark.timeout(300)

SCORING = {'accuracy': 'accuracy', 'nll': 'neg_log_loss'}


@pytest.fixture(scope='module')
def client(tmp_path_factory):
    # Dask's Nanny writes its workers' settings (MALLOC_TRIM_THRESHOLD_,
    # OMP_NUM_THREADS, ...) into this process's os.environ for good: the
    # tests after these get the environment back
    environ = dict(os.environ)
    with distributed.LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1,
            host='127.0.0.1', dashboard_address=None,
            local_directory=str(tmp_path_factory.mktemp('dask')),
            silence_logs=logging.ERROR) as cluster, \
            distributed.Client(cluster) as client:
        # the helpers reach every worker, present and future, and are
        # imported there now (an import error fails here, not in a search)
        client.upload_file(str(HELPERS))
        yield client
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(scope='module', autouse=True)
def one_torch_thread():
    # As on the workers (threads_per_worker=1). The nets are tiny: on a busy
    # machine, spinning OpenMP threads make the serial searches many times
    # slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def data():
    return dask_helpers.make_data()


def test_cluster_workers_are_separate_processes(client):
    pids = client.run(os.getpid)
    assert len(pids) == 2
    assert os.getpid() not in pids.values()
    assert len(set(pids.values())) == 2


def _test_results(search):
    """The test scores, ranks and parameters of a fitted search."""
    results = search.cv_results_
    return {key: value for key, value in results.items()
            if '_test_' in key or key == 'params'}


def _assert_same_results(local, remote):
    assert local.keys() == remote.keys()
    assert local['params'] == remote['params']
    for key in sorted(local):
        if key != 'params':
            # exactly: every candidate is seeded, so a worker process
            # trains the very same net as this one
            np.testing.assert_array_equal(remote[key], local[key],
                                          err_msg=key)


def _fit_on_cluster(client, search, X, y, backend_context):
    with distributed.get_task_stream(client=client) as tasks:
        with backend_context:
            search.fit(X, y)
    workers = {task['worker'] for task in tasks.data}
    # the fits really ran on the cluster's workers
    assert workers, 'no task ran on the cluster'
    assert workers <= set(client.scheduler_info()['workers'])
    return search


def test_grid_search_on_cluster_matches_local(client, data):
    X, y = data
    grid = [
        {'acc_steps': [1, 4], 'lr': [0.05, 0.2]},
        # these candidates keep the acc_steps=2 of the net that was pickled
        {'batch_size': [4, 16]},
    ]

    def search(n_jobs):
        return GridSearchCV(dask_helpers.make_net(acc_steps=2), grid, cv=2,
                            scoring=SCORING, refit=False, n_jobs=n_jobs)

    local = search(n_jobs=1).fit(X, y)
    remote = _fit_on_cluster(
        client, search(n_jobs=-1), X, y,
        joblib.parallel_config(backend='dask', client=client))

    local_results, remote_results = _test_results(local), _test_results(remote)
    assert len(remote_results['params']) == 6
    _assert_same_results(local_results, remote_results)
    # the candidates differ, so equal scores are not a coincidence
    assert len(set(local_results['mean_test_nll'])) == 6


def test_randomized_search_on_cluster_matches_local(client, data):
    X, y = data
    distributions = {'acc_steps': [1, 2, 3, 4], 'batch_size': [8, 16],
                     'lr': loguniform(0.01, 0.3)}

    def search(n_jobs):
        return RandomizedSearchCV(
            dask_helpers.make_net(), distributions, n_iter=3, cv=2,
            scoring=SCORING, refit='nll', n_jobs=n_jobs, random_state=0)

    local = search(n_jobs=1).fit(X, y)
    remote = _fit_on_cluster(client, search(n_jobs=-1), X, y,
                             joblib.parallel_backend('dask', client=client))

    _assert_same_results(_test_results(local), _test_results(remote))
    assert remote.best_params_ == local.best_params_
    # refit=True fits the best candidate here; it is the same net
    np.testing.assert_array_equal(remote.predict_proba(X),
                                  local.predict_proba(X))


def test_fitted_net_predicts_on_a_worker_as_here(client, data):
    X, y = data
    net = dask_helpers.make_net(acc_steps=4).fit(X, y)

    [scattered] = client.scatter([net], hash=False)
    proba, acc_steps, pid = client.submit(
        dask_helpers.predict_proba_in_worker, scattered, X).result()

    assert pid != os.getpid()
    assert acc_steps == 4
    np.testing.assert_array_equal(proba, net.predict_proba(X))


def test_net_fitted_on_a_worker_is_the_net_fitted_here(client, data):
    X, y = data
    here = dask_helpers.make_net(acc_steps=4).fit(X, y)

    future = client.submit(dask_helpers.fit_in_worker,
                           dask_helpers.make_net(acc_steps=4), X, y)
    there, pid = future.result()

    assert pid != os.getpid()
    assert type(there) is dask_helpers.SeededNet
    assert there.acc_steps == 4
    # it stepped once per 4 micro-batches of 8, on the worker
    assert [row['train_batch_size'] for row in there.history[0, 'batches']] == [
        row['train_batch_size'] for row in here.history[0, 'batches']]
    assert there.history[0, 'batches', 0, 'train_batch_size'] == 32
    np.testing.assert_array_equal(there.history[:, 'train_loss'],
                                  here.history[:, 'train_loss'])
    state_here = here.module_.state_dict()
    state_there = there.module_.state_dict()
    assert state_here.keys() == state_there.keys()
    for key in state_here:
        torch.testing.assert_close(state_there[key], state_here[key],
                                   rtol=0, atol=0)
    np.testing.assert_array_equal(there.predict_proba(X), here.predict_proba(X))
    # and it trains on here, from where the worker left it
    there.partial_fit(X, y)
    assert len(there.history) == 2 * there.max_epochs
