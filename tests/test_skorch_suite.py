"""skorch's own test-suite passes against the GradAcc nets, in three modes.

The suite ships inside skorch. It runs in subprocesses with the
``gradacc_swap`` plugin (``tests/skorch_suite/gradacc_swap.py``), which puts
the GradAcc nets in the place of skorch's wherever skorch's tests import them
from, and lists the tests that are out of scope, with the reason for each.
The modes (``GRADACC_SUITE_MODE``):

* ``plain``: the defaults, ``acc_steps=1``: plain skorch's training;
* ``stream``: ``micro_batch_size`` defaults to 32, so every training batch
  larger than that runs through the group loop in several pieces, and so
  do validation and prediction batches;
* ``acc2``: ``acc_steps=2`` over micro-batches of half the batch size each
  test asks for.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import skorch

pytest.importorskip('flaky')  # skorch's tests use it

SKORCH_TESTS = Path(skorch.__file__).parent / 'tests'
PLUGIN_DIR = Path(__file__).parent / 'skorch_suite'
sys.path.insert(0, str(PLUGIN_DIR))
from gradacc_swap import OUT_OF_SCOPE_IN_PIECES  # noqa: E402

# The stream mode runs everything that trains a net, and test_history
# (whose one net, with a shared history, is plain skorch's: gradacc_swap.py
# leaves it out). To keep the suite fast, the acc2 mode leaves out test_net,
# whose training paths the stream mode covers, and the plain mode runs of
# test_net only the tests that the modes in pieces leave out (LEFT_OUT).
SUITE = {
    'plain': ['test_net.py', 'test_classifier.py', 'test_regressor.py'],
    'stream': ['test_net.py', 'test_classifier.py', 'test_regressor.py',
               'callbacks', 'test_helper.py', 'test_history.py'],
    'acc2': ['test_classifier.py', 'test_regressor.py', 'callbacks',
             'test_helper.py'],
}
# at least this many tests pass in each mode (what passed when written,
# rounded down), so that a collection that silently shrinks fails
MIN_PASSED = {'plain': 50, 'stream': 800, 'acc2': 500}
# the plain mode's test_net: a -k expression (the other files of its job
# run whole: a file's name selects its tests)
LEFT_OUT = {('plain', 'test_net.py'): ' or '.join(sorted(OUT_OF_SCOPE_IN_PIECES))}
# Each mode's files run in processes of their own (each start takes about 8
# CPU-seconds), the longest first (run alone: 42, 35, 32 and 12 s), each job's
# files in their order in a fresh process, so that a module-scoped fixture such
# as TestNeuralNet's net_fit is trained from the same random state in every
# run. They start when the suite's collection ends, one at a time while the
# rest of the suite runs (it uses one core mostly, its background tasks the
# other), and two at a time once those tasks are done or the tests here wait
# for them (they run last; conftest.py).
JOBS = [('stream', ['test_net.py']),
        ('stream', ['callbacks', 'test_classifier.py', 'test_regressor.py',
                    'test_helper.py', 'test_history.py']),
        ('acc2', ['callbacks', 'test_classifier.py', 'test_regressor.py',
                  'test_helper.py']),
        ('plain', ['test_classifier.py', 'test_regressor.py', 'test_net.py'])]
TIME_LIMIT = 1500
NICENESS = 5


def _lower_priority():
    # beside the rest of the suite, a job takes the CPU that it leaves
    # (its tests, the torchrun ranks among them, keep their pace)
    if hasattr(os, 'nice'):
        os.nice(NICENESS)


class Jobs:
    """The JOBS of ``modes``, run in processes of their own, ``parallel`` at
    a time, in their order; :meth:`poll` starts and collects them."""

    def __init__(self, modes, parallel=1):
        self.waiting = [(mode, paths) for mode, paths in JOBS if mode in modes]
        self.parallel = parallel
        self.running, self.done, self.seconds = [], {}, []
        self.folder = tempfile.mkdtemp(prefix='skorch_suite-')

    def start(self, mode, paths):
        env = dict(os.environ, GRADACC_SUITE_MODE=mode,
                   PYTHONPATH=os.pathsep.join(
                       [str(PLUGIN_DIR), os.environ.get('PYTHONPATH', '')]))
        out = tempfile.TemporaryFile('w+')  # a pipe could fill unread
        proc = subprocess.Popen(
            [sys.executable, '-m', 'pytest', '-c',
             str(PLUGIN_DIR / 'pytest.ini'), '-p', 'gradacc_swap',
             *[str(SKORCH_TESTS / path) for path in paths],
             *self.selection(mode, paths),
             '-p', 'no:cacheprovider', '-p', 'no:xdist', '-W',
             'ignore::pytest.PytestRemovedIn10Warning'],
            # a folder each: skorch's tests write checkpoints to the
            # working directory, and two jobs run at once
            cwd=tempfile.mkdtemp(dir=self.folder), env=env, stdout=out,
            stderr=subprocess.STDOUT,
            text=True, preexec_fn=_lower_priority)
        self.running.append((mode, paths, proc, out, time.monotonic()))

    @staticmethod
    def selection(mode, paths):
        """The ``-k`` option of a job whose files LEFT_OUT names, if any."""
        if not any((mode, path) in LEFT_OUT for path in paths):
            return []
        return ['-k', ' or '.join(LEFT_OUT.get((mode, path), path)
                                  for path in paths)]

    def poll(self):
        """Collect the jobs that ended and start waiting ones; whether any
        job is left."""
        for job in list(self.running):
            mode, paths, proc, out, start = job
            if proc.poll() is None:
                continue
            out.seek(0)
            self.done.setdefault(mode, []).append((proc.returncode, out.read()))
            out.close()
            self.seconds.append((time.monotonic() - start, mode, paths))
            self.running.remove(job)
        while self.waiting and len(self.running) < self.parallel:
            self.start(*self.waiting.pop(0))
        return bool(self.running)

    def wait(self, timeout=TIME_LIMIT, parallel=2):
        """Run the jobs left ``parallel`` at a time; every mode's outputs."""
        self.parallel = parallel
        end = time.monotonic() + timeout
        while self.poll():
            if time.monotonic() > end:
                self.stop()
                pytest.fail('the jobs ran past {} s: {}'.format(
                    timeout, self.seconds))
            time.sleep(0.5)
        return self.done

    def stop(self):
        """Kill the jobs still running; remove their folder."""
        self.waiting = []
        for mode, _, proc, out, _ in self.running:
            proc.kill()
            proc.wait()
            out.close()
            self.done.setdefault(mode, []).append((proc.returncode, 'killed'))
        self.running = []
        shutil.rmtree(self.folder, ignore_errors=True)


# started by conftest.py when the collection ends (start_jobs)
JOBS_STARTED = []


def start_jobs(items):
    """Start the jobs of the modes that ``items`` test."""
    if not JOBS_STARTED:
        JOBS_STARTED.append(Jobs({item.callspec.params['mode']
                                  for item in items}))
        JOBS_STARTED[0].poll()
    return JOBS_STARTED[0]


@pytest.fixture(scope='module')
def suite(request):
    """Every mode's outputs."""
    assert sorted((mode, path) for mode, paths in JOBS for path in paths) == (
        sorted((mode, path) for mode, paths in SUITE.items()
               for path in paths))
    jobs = start_jobs([item for item in request.session.items
                       if getattr(item, 'module', None) is request.module])
    try:
        yield jobs.wait()
    finally:
        for seconds, mode, paths in jobs.seconds:
            print('{:.0f} s: {} {}'.format(seconds, mode, ' '.join(paths)))
        jobs.stop()


@pytest.mark.timeout(TIME_LIMIT + 60)
@pytest.mark.parametrize('mode', list(SUITE))
def test_skorch_suite_passes_on_grad_acc_nets(suite, mode):
    passed = 0
    for returncode, out in suite[mode]:
        assert ('gradacc_swap: skorch.NeuralNet, skorch.NeuralNetClassifier, '
                'skorch.NeuralNetBinaryClassifier, skorch.NeuralNetRegressor '
                'are the GradAcc nets, mode {}'.format(mode)) in out
        assert returncode == 0, out[-6000:]
        passed += int(re.search(r'(\d+) passed', out).group(1))
    assert passed >= MIN_PASSED[mode], [out[-2000:] for _, out in suite[mode]]
