"""What the torchrun workers share: the process group, scenarios, teardown.

A worker's command line is ``OUT_DIR SCENARIOS [ARGS]``, where SCENARIOS is
a comma-separated list: :func:`run_scenarios` runs them one after another in
one process group, so that one launch of torchrun (seconds of start-up)
serves many tests. ``WORKER:NAME`` is another worker's scenario (a module
here, whose ``run(NAME, folder)`` runs it): one launch serves the tests of
several modules (conftest.py's ``ddp_launch`` and ``fsdp_launch``). Each
scenario starts from the same seed, with a new net, and writes to its own
folder OUT_DIR/SCENARIO; it ends with each rank's ``rank{r}.pt``
(:func:`save_rank`), which the tests take as its mark of completion. A
scenario that raises writes its traceback to
OUT_DIR/SCENARIO/error-rank{r}.txt and ends the rank, as it would end a
user's script: torchrun then stops the other ranks, which could otherwise
wait forever in a collective, and the scenarios after it leave no output.

A scenario that hangs ends the same way: under a launch of
tests/torchrun_launch.py, each scenario, the set-up and the teardown have
a time limit (:func:`deadline`), past which the rank writes where it waits
to the scenario's error file and exits.
"""

import contextlib
import faulthandler
import functools
import importlib
import os
import sys
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def scenario_dir(out_dir, scenario):
    """The folder of one scenario's outputs, created if need be."""
    path = Path(out_dir) / scenario
    path.mkdir(parents=True, exist_ok=True)
    return path


# seconds a scenario may take, set by tests/torchrun_launch.py; no limit if
# unset (a worker run by hand)
LIMIT_VAR = 'SKORCH_GRADACC_TEST_SCENARIO_LIMIT'
# how much longer faulthandler waits, for a hang that holds the GIL and so
# keeps the timer's thread from running
GIL_GRACE = 15


@contextlib.contextmanager
def deadline(what, folder=None):
    """End the rank if the block runs past the limit in ``$LIMIT_VAR``.

    A rank that waits forever (a collective that another rank never joins)
    would otherwise hold the launch until the test's own timeout. Past the
    limit, the rank writes ``what`` it was doing and every thread's stack to
    stderr and to ``folder/error-rank{r}.txt``, and exits with 1: torchrun
    then stops the other ranks.
    """
    limit = float(os.environ.get(LIMIT_VAR) or 0)
    if not limit:
        yield
        return
    rank = os.environ.get('RANK')

    def expire():
        message = ('{} ran past its limit of {:g} s on rank {} (a hang, or a '
                   'machine too loaded for {}); each thread was at:\n'.format(
                       what, limit, rank, LIMIT_VAR))
        files = [sys.stderr]
        if folder is not None:
            files.append(open(Path(folder) / 'error-rank{}.txt'.format(rank),
                              'w'))
        for file in files:
            file.write(message)
            file.flush()
            faulthandler.dump_traceback(file)
            file.flush()
        os._exit(1)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(limit + GIL_GRACE, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def save_rank(obj, folder, save=torch.save):
    """Save this rank's results as ``folder/rank{r}.pt``, whole or not at
    all: the file is written under another name and renamed."""
    path = Path(folder) / 'rank{}.pt'.format(int(os.environ['RANK']))
    tmp = path.with_name(path.name + '.part')
    save(obj, tmp)
    os.replace(tmp, path)


def run_scenarios(out_dir, scenarios, run_one, backend='gloo',
                  init_group=True):
    """Run each of the comma-separated ``scenarios`` with
    ``run_one(scenario, folder)``, then tear down (:func:`finish`).

    Before each scenario every rank seeds torch with 0 (the same initial
    weights on every rank). With ``init_group=False`` the first scenario
    sets up the process group itself (Accelerate does).
    """
    if init_group:
        with deadline("the process group's set-up"):
            dist.init_process_group(backend)
    for scenario in scenarios.split(','):
        folder = scenario_dir(out_dir, scenario)
        torch.manual_seed(0)
        try:
            with deadline('scenario {!r}'.format(scenario), folder):
                runner(scenario, run_one)(folder)
        except BaseException:
            (folder / 'error-rank{}.txt'.format(os.environ.get('RANK'))
             ).write_text(traceback.format_exc())
            raise  # as a user's script would: torchrun stops the other ranks
    finish()


def runner(scenario, run_one):
    """What runs ``scenario`` in a folder: ``run_one``, or for
    ``WORKER:NAME`` the worker module's ``run`` with ``NAME``."""
    worker, _, name = scenario.rpartition(':')
    if not worker:
        return functools.partial(run_one, scenario)
    return functools.partial(importlib.import_module(worker).run, name)


def finish():
    """End the rank once every rank is done."""
    with deadline('the teardown'):
        dist.barrier()  # no rank tears down while another still talks
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)
