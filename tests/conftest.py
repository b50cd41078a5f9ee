"""Shared fixtures and helpers.

The oracle for most tests is plain skorch with ``batch_size * acc_steps``
("the large-batch net") on the same data in the same order, in float64.
"""

import copy
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.datasets import make_classification, make_regression
from skorch import NeuralNetClassifier, NeuralNetRegressor
from skorch.callbacks import Callback

from skorch_gradacc import GradAccNeuralNetClassifier, GradAccNeuralNetRegressor

# One torch thread, here and in the processes the tests start: the models
# are tiny, and two threads on two busy cores wait on each other (a fit of
# the README's net took 50x longer with two while the suite ran).
os.environ['OMP_NUM_THREADS'] = '1'
torch.set_num_threads(1)

# float64 for every test: tolerances can then be tight.
DTYPE = torch.float64
PARAM_ATOL = 1e-10

# skorch's compile=True, with torch.compile's backend 'aot_eager': dynamo's
# graphs and AOT autograd, as inductor gets them, without inductor's C++
# builds, which took 74 CPU-seconds of the distributed tests where its cache
# (/tmp/torchinductor_<user>) was empty, as on a fresh CI machine
COMPILED = {'compile': True, 'compile__backend': 'aot_eager'}


class MLPClassifier(torch.nn.Module):
    """A small MLP with softmax output (no BatchNorm, no dropout); float64
    unless ``dtype`` says otherwise."""

    def __init__(self, n_in=10, n_hidden=16, n_out=3, dtype=DTYPE):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, n_hidden, dtype=dtype)
        self.output = torch.nn.Linear(n_hidden, n_out, dtype=dtype)

    def forward(self, X):
        return torch.softmax(self.output(torch.tanh(self.hidden(X))), dim=-1)


class RefusesZeroRows:
    """Put in front of a module: it refuses a batch of zero rows, as a
    Hugging Face model does (it reshapes its attention mask by the rows)."""

    def forward(self, X):
        if not len(X):
            raise ValueError('cannot reshape tensor of 0 elements')
        return super().forward(X)


class RowsNeededMLP(RefusesZeroRows, MLPClassifier):
    """MLPClassifier that refuses a batch of zero rows."""


class NormalizedMLP(MLPClassifier):
    """MLPClassifier with a BatchNorm over its hidden layer."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(16, dtype=DTYPE)

    def forward(self, X):
        return torch.softmax(self.output(torch.tanh(self.norm(self.hidden(X)))), dim=-1)


class ConvMLPClassifier(MLPClassifier):
    """MLPClassifier after a convolution of one channel, kernel 1: the plan
    tries the last piece of a micro-batch too (in float64, oneDNN compiles
    no code for it)."""

    def __init__(self, n_in=10, n_hidden=16, n_out=3, dtype=DTYPE):
        super().__init__(n_in, n_hidden, n_out, dtype)
        self.conv = torch.nn.Conv1d(1, 1, 1, dtype=dtype)

    def forward(self, X):
        return super().forward(self.conv(X[:, None, :])[:, 0])


class TemperedNLL(torch.nn.Module):
    """A criterion with a parameter of its own, which skorch trains: the NLL
    of probabilities sharpened by a learnable temperature, and scaled by a
    frozen one (``requires_grad=False``: no gradient, no update)."""

    def __init__(self):
        super().__init__()
        self.log_t = torch.nn.Parameter(torch.zeros((), dtype=DTYPE))
        self.scale = torch.nn.Parameter(torch.ones((), dtype=DTYPE),
                                        requires_grad=False)

    def forward(self, y_proba, y):
        logits = torch.log(y_proba) * self.log_t.exp() * self.scale
        return torch.nn.functional.cross_entropy(logits, y)


class ShiftedTemperedNLL(TemperedNLL):
    """``TemperedNLL`` whose logits are shifted by a learnable vector, one
    value per class of ``classification_data``: a parameter of more than
    0 dimensions."""

    def __init__(self):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(3, dtype=DTYPE))

    def forward(self, y_proba, y):
        logits = torch.log(y_proba) * self.log_t.exp() * self.scale
        return torch.nn.functional.cross_entropy(logits + self.shift, y)


class FirstIsBest(Callback):
    """Records ``first_best``: the first epoch is the best, for a
    ``Checkpoint(monitor='first_best')``."""

    train_batch_reads = ()

    def on_epoch_end(self, net, **kwargs):
        net.history.record('first_best', len(net.history) == 1)


class Conv2dFront(torch.nn.Module):
    """A float32 convolution of ``channels`` channels over each row spread
    to an image: on the CPU, oneDNN compiles code for each new number of
    rows. Returns features of the row, in the input's dtype."""

    def __init__(self, channels=5):
        super().__init__()
        self.channels = channels
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, X):
        image = X.float()[:, None, None, :].expand(
            -1, self.channels, 9, X.shape[1])
        return self.conv(image).mean(dim=(1, 2)).to(X.dtype)


class MLPRegressor(torch.nn.Module):
    def __init__(self, n_in=10, n_hidden=16):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, n_hidden, dtype=DTYPE)
        self.output = torch.nn.Linear(n_hidden, 1, dtype=DTYPE)

    def forward(self, X):
        return self.output(torch.tanh(self.hidden(X)))


class RecordParams(Callback):
    """Keep a copy of the module's parameters at the end of every epoch."""

    def initialize(self):
        self.params_ = []
        return self

    def on_epoch_end(self, net, **kwargs):
        self.params_.append(copy.deepcopy(net.module_.state_dict()))


class RecordsGradBatches(Callback):
    """Note the rows of a training step's batch in ``on_grad_computed``: the
    large batch's, over ranks."""

    train_batch_reads = ('X', 'y')

    def initialize(self):
        self.records_ = []
        return self

    def on_grad_computed(self, net, named_parameters, batch=None, **kwargs):
        self.records_.append(('grad', len(batch[1])))


class RecordsStepBatches(RecordsGradBatches):
    """And the targets it gives in ``on_batch_begin``."""

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        if training:
            self.records_.append(('begin', np.asarray(batch[1]).tolist()))


def classification_data(n_samples=203, seed=0):
    X, y = make_classification(
        n_samples=n_samples, n_features=10, n_informative=6, n_classes=3,
        random_state=seed)
    return X.astype(np.float64), y.astype(np.int64)


def regression_data(n_samples=203, seed=0):
    X, y = make_regression(
        n_samples=n_samples, n_features=10, noise=1.0, random_state=seed)
    return X.astype(np.float64), (y / 100).astype(np.float64).reshape(-1, 1)


@pytest.fixture
def clf_data():
    return classification_data()


@pytest.fixture
def reg_data():
    return regression_data()


def make_nets(acc_steps, batch_size=8, kind='classifier', **kwargs):
    """Return ``(accumulating net, large-batch net)`` with identical settings.

    Both record their parameters after each epoch in the ``record_params``
    callback.
    """
    if kind == 'classifier':
        acc_cls, plain_cls, module = (
            GradAccNeuralNetClassifier, NeuralNetClassifier, MLPClassifier)
    else:
        acc_cls, plain_cls, module = (
            GradAccNeuralNetRegressor, NeuralNetRegressor, MLPRegressor)
    module = kwargs.pop('module', module)
    kwargs.setdefault('max_epochs', 3)
    kwargs.setdefault('lr', 0.1)
    kwargs.setdefault('verbose', 0)
    callbacks = kwargs.pop('callbacks', [])
    acc_net = acc_cls(
        module, batch_size=batch_size, acc_steps=acc_steps,
        callbacks=[('record_params', RecordParams())] + callbacks, **kwargs)
    plain_net = plain_cls(
        module, batch_size=batch_size * acc_steps,
        callbacks=[('record_params', RecordParams())] + copy.deepcopy(callbacks),
        **kwargs)
    return acc_net, plain_net


def fit_seeded(net, X, y=None, seed=0, **fit_params):
    """Fit with a fixed torch seed, so that two nets see the same order."""
    torch.manual_seed(seed)
    return net.fit(X, y, **fit_params)


def fit_pair(acc_steps, X, y, batch_size=8, kind='classifier', **kwargs):
    acc_net, plain_net = make_nets(acc_steps, batch_size, kind=kind, **kwargs)
    return fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)


def param_diff(net_a, net_b):
    """The largest absolute difference between two nets' parameters now."""
    params = dict(net_b.module_.named_parameters())
    return max((param - params[name]).abs().max().item()
               for name, param in net_a.module_.named_parameters())


def max_param_diff(net_a, net_b):
    """The largest absolute parameter difference after each epoch."""
    diffs = []
    for params_a, params_b in zip(
            dict(net_a.callbacks_)['record_params'].params_,
            dict(net_b.callbacks_)['record_params'].params_):
        assert params_a.keys() == params_b.keys()
        diffs.append(max(
            (params_a[key] - params_b[key]).abs().max().item()
            for key in params_a))
    assert len(diffs) == len(net_a.history) == len(net_b.history)
    return max(diffs)


def train_rows(history, epoch=-1):
    """The training batch rows of one epoch."""
    return [row for row in history[epoch, 'batches'] if 'train_loss' in row]


def assert_same_history(acc_net, plain_net, rtol=1e-10, ignore=()):
    """Epoch losses, scores, and training batch rows are the same.

    ``ignore`` names epoch keys that only the accumulating net records.
    """
    hist_a, hist_b = acc_net.history, plain_net.history
    assert len(hist_a) == len(hist_b)
    skipped = {'dur', 'batches', 'valid_batch_count', *ignore}
    for epoch_a, epoch_b in zip(hist_a, hist_b):
        keys = set(epoch_a) - skipped
        assert keys == set(epoch_b) - skipped
        for key in sorted(keys):
            if isinstance(epoch_a[key], float):
                np.testing.assert_allclose(
                    epoch_a[key], epoch_b[key], rtol=rtol, err_msg=key)
            else:
                assert epoch_a[key] == epoch_b[key], key
    for epoch in range(len(hist_a)):
        rows_a, rows_b = train_rows(hist_a, epoch), train_rows(hist_b, epoch)
        assert [row['train_batch_size'] for row in rows_a] == [
            row['train_batch_size'] for row in rows_b]
        np.testing.assert_allclose(
            [row['train_loss'] for row in rows_a],
            [row['train_loss'] for row in rows_b], rtol=rtol)


ROOT = Path(__file__).resolve().parent.parent
KERNEL_NAME = 'python3'


def kernel_env(folder):
    """The environment, and a ``python3`` kernelspec in ``folder``, for
    running a notebook with this interpreter whatever Jupyter kernels the
    machine has: ``JUPYTER_PATH``, which Jupyter searches first, holds the
    kernelspec; the checkout is on ``PYTHONPATH``."""
    spec_dir = Path(folder) / 'jupyter' / 'kernels' / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / 'kernel.json').write_text(json.dumps({
        'argv': [sys.executable, '-m', 'ipykernel_launcher',
                 '-f', '{connection_file}'],
        'display_name': 'Python 3 (test)',
        'language': 'python',
    }))
    env = dict(os.environ, JUPYTER_PATH=os.pathsep.join(filter(None, [
        str(Path(folder) / 'jupyter'), os.environ.get('JUPYTER_PATH')])),
        PYTHONPATH=os.pathsep.join(filter(None, [
            str(ROOT), os.environ.get('PYTHONPATH')])),
        # the notebooks' models are tiny: one thread per kernel is fastest
        # and spins no OpenMP threads on a busy machine
        OMP_NUM_THREADS='1')
    # inline figures, as in Jupyter, whatever MPLBACKEND the runner has
    env.pop('MPLBACKEND', None)
    return env


def readme_notebook_command():
    """The README's command that runs a notebook, and the notebook's path."""
    command = re.search(r'```bash\n(jupyter execute .*?)\n```',
                        (ROOT / 'README.md').read_text()).group(1)
    return command, Path(shlex.split(command)[-1])


def run_readme_notebook():
    """The README's notebook command, run on a copy of the notebook, with
    jupyter from this environment (test_readme.py checks the command,
    test_notebooks.py what the notebook showed): the command's process and
    the executed copy (``--inplace`` writes the outputs into it)."""
    command, notebook = readme_notebook_command()
    folder = Path(background_folder('readme_notebook'))
    (folder / notebook.parent).mkdir(parents=True)
    shutil.copy(ROOT / notebook, folder / notebook)
    env = kernel_env(folder)
    env['PATH'] = os.pathsep.join([str(Path(sys.executable).parent),
                                   os.environ.get('PATH', '')])
    proc = subprocess.run(shlex.split(command), cwd=folder, env=env,
                          capture_output=True, text=True, timeout=840)
    return SimpleNamespace(proc=proc, notebook=notebook,
                           executed=folder / notebook)


@pytest.fixture
def readme_notebook():
    """What :func:`run_readme_notebook` ran, once for the session, in the
    background; a test that asks for it has the mark
    ``background(run_readme_notebook)``."""
    return background_result(run_readme_notebook)


# Work that the tests start in processes and wait for (notebooks, benchmark
# runs, torchrun launches) runs in the background from the collection's
# end, beside the tests that run in this process (they use one core
# mostly): a test marked ``@background(task, ...)`` runs after the others
# (but skorch's suite), and reads the result of each ``task``, a function
# without arguments, with ``background_result(task)``. Two tasks at a
# time, at the lower priority of skorch's suite (test_skorch_suite.py), so
# that the tests here keep their pace, and the tasks theirs beside skorch's.
BACKGROUND_PARALLEL = 2
BACKGROUND_NICENESS = 5


def _lower_thread_priority():
    # Linux gives each thread its own niceness, which the processes that it
    # starts inherit: the tasks' threads, not pytest's, run lower
    if sys.platform == 'linux':
        os.nice(BACKGROUND_NICENESS)


class Background:
    """The tasks under way: a future for each."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(BACKGROUND_PARALLEL,
                                       thread_name_prefix='background',
                                       initializer=_lower_thread_priority)
        self.futures = {}
        self.lock = threading.Lock()
        self.folder = None

    def start(self, task):
        with self.lock:
            if task not in self.futures:
                self.futures[task] = self.pool.submit(task)
            return self.futures[task]

    def busy(self):
        """Whether a task is running or waiting."""
        with self.lock:
            return not all(future.done() for future in self.futures.values())

    def stop(self):
        """Cancel the tasks not started; those running end on their own
        time limits (pytest waits for them as it exits)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


_BACKGROUND = Background()


def background(*tasks):
    """The mark of a test that reads the results of ``tasks``."""
    # with_args: a lone function would be taken for the marked test
    return pytest.mark.background.with_args(*tasks)


def background_result(task):
    """The result of ``task``, started now if it was not (the test ran
    alone, say); what it raised is raised here."""
    return _BACKGROUND.start(task).result()


def background_folder(name):
    """A new folder for a task's files, removed when the session ends."""
    with _BACKGROUND.lock:
        if _BACKGROUND.folder is None:
            _BACKGROUND.folder = tempfile.mkdtemp(prefix='pytest-background-')
    return Path(tempfile.mkdtemp(prefix=name + '-', dir=_BACKGROUND.folder))


def _background_tasks(item):
    return [task for mark in item.iter_markers('background')
            for task in mark.args]


def assert_ranks_backed_off_alike(ranks, rows, max_rows, planned):
    """Data-parallel ranks (the torchrun tests' results) planned whole
    micro-batches of ``planned`` rows, then backed off in one batch's row
    (``rows``: each rank's rows that recorded a back-off, the sizes last),
    the same on every rank: first to half (rounded up) the least piece that
    failed on any rank, then each size half the one before, to the same
    size, which every rank's module takes. Returns the sizes backed off to."""
    assert rows[0] == rows[1]
    assert len(rows[0]) == 1, rows[0]  # one batch's row, and no other
    sizes = rows[0][0][-1]
    for rank in ranks:
        # budget None: the plan takes whole micro-batches, which fail
        # later (the plan was wrong)
        assert rank['memory_plan_']['micro_batch_size'] == planned
    # the pieces that failed first, on the ranks that failed
    failed = [rank['failed_rows'][0] for rank in ranks if rank['failed_rows']]
    tried = [min(failed)] + sizes
    assert all(size == (before + 1) // 2
               for before, size in zip(tried, tried[1:])), tried
    assert [rank['micro_batch_size_'] for rank in ranks] == [sizes[-1]] * 2
    assert sizes[-1] <= min(max_rows)
    return sizes


# The tests that measure this process's resident memory (a fit's plan and
# its peak against a budget, marked ``own_process``) run together in a fresh
# pytest process, started at the first of them: here, the background tasks'
# threads allocate and free beside them, and the process holds what every
# earlier test left, none of which a user's fit has. In that process, the
# variable names the file of the results that this one reports.
OWN_PROCESS = 'SKORCH_GRADACC_OWN_PROCESS'
_OWN_PROCESS_RESULTS = {}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker('own_process') is None or os.environ.get(
            OWN_PROCESS):
        return None
    if not _OWN_PROCESS_RESULTS:
        _OWN_PROCESS_RESULTS.update(_run_in_own_process(pyfuncitem.session))
    outcome, text = _OWN_PROCESS_RESULTS.get(
        pyfuncitem.nodeid, ('failed', 'the process of its own did not run it'))
    if outcome == 'skipped':
        pytest.skip(text)
    if outcome != 'passed':
        pytest.fail('in a process of its own:\n' + text, pytrace=False)
    return True


def _run_in_own_process(session):
    """Each ``own_process`` test's outcome and report, from one new process."""
    nodeids = [item.nodeid for item in session.items
               if item.get_closest_marker('own_process')]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / 'results.json'
        proc = subprocess.run(
            [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
             *nodeids], cwd=session.config.rootpath, capture_output=True,
            text=True, env=dict(os.environ, **{OWN_PROCESS: str(path)}),
            timeout=900)
        if path.exists():
            return json.loads(path.read_text())
    return dict.fromkeys(nodeids, ('failed', proc.stdout[-6000:] + proc.stderr))


def pytest_runtest_logreport(report):
    path = os.environ.get(OWN_PROCESS)
    if path and (report.when == 'call' or report.outcome != 'passed'):
        results = json.loads(Path(path).read_text()) if Path(
            path).exists() else {}
        if results.get(report.nodeid, ('passed',))[0] == 'passed':
            results[report.nodeid] = (report.outcome, report.longreprtext)
        Path(path).write_text(json.dumps(results))


@pytest.fixture(scope='session', autouse=True)
def trained_once():
    """In the process of their own, a fit before the tests: what the first
    fit of a process adds once (torch's optimizers import its compiler)."""
    if os.environ.get(OWN_PROCESS):
        X, y = classification_data()
        for optimizer in (torch.optim.SGD, torch.optim.Adam):
            GradAccNeuralNetClassifier(
                MLPClassifier, optimizer=optimizer, batch_size=16,
                micro_batch_size='auto', max_epochs=1, train_split=None,
                verbose=0).fit(X[:32], y[:32])
    yield


# The torchrun launches that the tests of several modules read: each start
# of torchrun and its two ranks takes about 13 CPU-seconds, far more than
# most scenarios. The host module lists every scenario of its launch, the
# other modules' as ``WORKER:NAME`` (torchrun_scripts/worker_common.py).


@pytest.fixture(scope='session')
def ddp_launch(tmp_path_factory):
    """One launch of ddp_worker.py for test_distributed.py's SCENARIOS."""
    return _shared_launch('test_distributed', tmp_path_factory)


@pytest.fixture(scope='session')
def fsdp_launch(tmp_path_factory):
    """One launch of fsdp_worker.py for test_fully_sharded.py's SCENARIOS."""
    return _shared_launch('test_fully_sharded', tmp_path_factory)


def _shared_launch(host, tmp_path_factory):
    from torchrun_launch import launch_scenarios
    module = importlib.import_module(host)
    return launch_scenarios(module.WORKER, tmp_path_factory.mktemp(host),
                            module.SCENARIOS, timeout=module.LAUNCH_LIMIT)


# FSDP2 needs torch 2.8 (skorch_gradacc.fully_sharded refuses older ones at
# import): below it, the modules that import it are not collected, so that
# the quick suite runs at the floors (requirements/floor.txt). Asked only by
# pytest, not when this module is imported: the torchrun ranks of the DDP
# tests import it for its helpers, and the import of fully_sharded took a
# third of their start-up.
NEEDS_FSDP2 = [
    'test_fully_sharded.py', 'test_sharded_evaluation.py',
    'torchrun_scripts/checkpoint_worker.py',
    'torchrun_scripts/dropout_worker.py', 'torchrun_scripts/eval_worker.py',
    'torchrun_scripts/fsdp_worker.py',
]
collect_ignore = []  # NEEDS_FSDP2 below torch 2.8 (pytest_configure)


def has_fsdp2():
    """Whether skorch_gradacc.fully_sharded imports (torch 2.8 or later)."""
    try:
        import skorch_gradacc.fully_sharded  # noqa: F401
    except ImportError:
        return False
    return True



def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'background(*tasks): the test reads the results of tasks '
        'that run in the background from the end of the collection '
        '(conftest.py); it runs after the tests without the mark')
    config.addinivalue_line(
        'markers', 'own_process: the test runs in a fresh pytest process, '
        'with the others of the mark (conftest.py)')
    if not has_fsdp2():
        collect_ignore.extend(NEEDS_FSDP2)
        # the package's module, collected for its doctests, is outside
        # this folder, where collect_ignore does not reach
        config.option.ignore = [*(config.option.ignore or []), str(
            Path(__file__).parent.parent / 'skorch_gradacc' / 'fully_sharded.py')]


# Modules whose every test starts processes, clusters or whole trainings:
# marked slow here, in one place, so that `python -m pytest -m "not slow"`
# is a quick inner loop. CI runs everything. In the other modules, a slow
# test is marked on its own (test_docs, test_packaging, test_readme, and the
# torchrun tests of test_distributed and test_fully_sharded), and a quick
# test of a slow module's subject lives in a module of its own (test_sharding
# beside test_distributed).
SLOW_MODULES = {
    'test_benchmarks', 'test_dask', 'test_demo', 'test_notebooks',
    'test_properties', 'test_sklearn_checks', 'test_skorch_suite', 'test_stream_memory',
    'test_transformers_recipe',
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, 'module', None)
        if module is not None and module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # skorch's suite runs in processes of their own, started when the
    # collection ends (pytest_collection_finish) beside the rest of the
    # suite; its tests, which wait for them, run last, and those that wait
    # for background tasks before them
    items.sort(key=lambda item: (_module_name(item) == 'test_skorch_suite',
                                 bool(_background_tasks(item))))


def _module_name(item):
    module = getattr(item, 'module', None)
    return module and module.__name__


# the jobs of test_skorch_suite, if its tests run: under way
_SKORCH_SUITE_JOBS = []


def pytest_collection_finish(session):
    if session.config.option.collectonly or (
            session.testsfailed
            and not session.config.option.continue_on_collection_errors):
        return  # no test will run
    for item in session.items:  # in the order their tests run
        for task in _background_tasks(item):
            _BACKGROUND.start(task)
    items = [item for item in session.items
             if _module_name(item) == 'test_skorch_suite']
    if items:
        _SKORCH_SUITE_JOBS.append(items[0].module.start_jobs(items))


def pytest_runtest_logfinish(nodeid, location):
    for jobs in _SKORCH_SUITE_JOBS:  # start the next job if one has ended
        # two at a time once the background tasks are done: the core that
        # they used would be idle
        jobs.parallel = 1 if _BACKGROUND.busy() else 2
        jobs.poll()


def pytest_sessionfinish(session, exitstatus):
    for jobs in _SKORCH_SUITE_JOBS:  # after an interruption, say
        jobs.stop()
    _BACKGROUND.stop()
