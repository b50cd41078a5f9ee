"""Start a worker of tests/torchrun_scripts under torchrun, and read what
each scenario left (see torchrun_scripts/worker_common.py).

Starting torchrun and its ranks, each importing torch and skorch, takes
seconds, far longer than the small fits the tests run: a module launches
once with every scenario its tests need (a module-scoped fixture, or
conftest.py's ``ddp_launch`` and ``fsdp_launch``, which serve several
modules), and each test reads its own scenario's outputs with
:meth:`Launch.ranks`.

A hang fails fast and leaves nothing behind. Each scenario has a time limit
(``scenario_limit``, enforced by the worker: torchrun_scripts/
worker_common.py), and the test that reads it names it; the launch as a whole
has one too (``timeout``), past which every process of the launch is
killed. torchrun starts each worker in a session of its own, beyond the
reach of the launcher's process group: the launch marks its environment,
which every process it starts inherits, and :func:`kill_launch` kills each
process with the mark.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

WORLD_SIZE = 2
TIME_LIMIT = 240
# seconds a scenario (or the set-up of the process group) may take: those of
# test_distributed.py and test_fully_sharded.py take 2 s at most on a quiet
# machine; the rest is for a loaded machine, and for a rank that waits in
# the set-up for another still importing
SCENARIO_LIMIT = 60
# seconds a launch that conftest.py's ddp_launch or fsdp_launch shares may
# take: its host module's LAUNCH_LIMIT; a test that reads it waits a minute
# more, for what the launch's start takes
SHARED_LAUNCH_LIMIT = 480
TAIL = 3000
# the variable whose value marks the processes of one launch
MARK_VAR = 'SKORCH_GRADACC_TEST_LAUNCH'
LIMIT_VAR = 'SKORCH_GRADACC_TEST_SCENARIO_LIMIT'  # read by worker_common.py


class Launch:
    """One torchrun launch: its exit status, its output, its folder."""

    def __init__(self, out_dir, returncode, stdout, stderr, timed_out=False):
        self.out_dir = Path(out_dir)
        self.returncode = returncode
        self.stdout, self.stderr = stdout, stderr
        self.timed_out = timed_out

    @property
    def output(self):
        return self.stdout + self.stderr

    def errors(self):
        """What the ranks wrote to the error files of the scenarios."""
        return ''.join(path.read_text() for path in sorted(
            self.out_dir.glob('*/error-*')))

    def tail(self):
        errors = self.errors()
        return 'launch {}:\n{}{}{}'.format(
            'timed out' if self.timed_out else
            'exited with {}'.format(self.returncode),
            'the scenarios raised:\n' + errors[-TAIL:] + '\nits output:\n'
            if errors else '', self.stdout[-TAIL:], self.stderr[-TAIL:])

    def folder(self, scenario):
        return self.out_dir / scenario

    def ranks(self, scenario, nproc=WORLD_SIZE, **load_kwargs):
        """Each rank's results of ``scenario``; the test fails, with the
        scenario's errors and the launch's output, if any is missing."""
        folder = self.folder(scenario)
        paths = [folder / 'rank{}.pt'.format(rank) for rank in range(nproc)]
        if not all(path.exists() for path in paths):
            errors = ''.join(
                path.read_text() for path in sorted(folder.glob('error-*')))
            pytest.fail('scenario {!r} left no results{}\n{}'.format(
                scenario, ', it raised:\n' + errors if errors else '',
                self.tail()), pytrace=False)
        return [torch.load(path, **load_kwargs) for path in paths]


def marked_processes(mark):
    """The ids of the live processes whose environment has ``mark``."""
    entry = '{}={}'.format(MARK_VAR, mark).encode()
    pids = []
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/{}/environ'.format(name), 'rb') as file:
                if entry in file.read().split(b'\0'):
                    pids.append(int(name))
        except OSError:  # gone, or not ours
            continue
    return pids


def kill_launch(proc, mark):
    """Kill the launcher ``proc`` and every process it started, wherever
    they are now (torchrun's workers have sessions of their own; a worker
    whose launcher died has a new parent)."""
    if not os.path.isdir('/proc'):  # not Linux: the launcher's own session
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        return
    for _ in range(50):  # the launcher first, so that it starts no more
        pids = marked_processes(mark)
        if not pids:
            return
        for pid in sorted(pids, key=lambda pid: pid != proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.poll()  # reap the launcher
        time.sleep(0.1)


def launch(script, out_dir, *args, nproc=WORLD_SIZE, options=('--standalone',),
           env=None, cwd=None, timeout=TIME_LIMIT,
           scenario_limit=SCENARIO_LIMIT):
    """Run ``torchrun OPTIONS --nproc_per_node NPROC SCRIPT *ARGS``.

    Each scenario of the worker may run ``scenario_limit`` seconds (None: no
    limit): past it, the rank ends and says where it waits (see
    worker_common.py). A launch that runs past ``timeout`` is killed with
    all its ranks and returned with ``timed_out``. However the launch ends,
    no process of it outlives this call.
    """
    mark = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS='1', **(env or {}),
               **{MARK_VAR: mark, LIMIT_VAR: str(scenario_limit or '')})
    command = [sys.executable, '-m', 'torch.distributed.run', *options,
               '--nproc_per_node', str(nproc), str(script),
               *[str(arg) for arg in args]]
    proc = subprocess.Popen(command, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    end, timed_out = time.monotonic() + timeout, False
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if proc.poll() is not None:
                    # torchrun is done; a process it leaves holds the pipes
                    kill_launch(proc, mark)
                elif time.monotonic() > end:
                    timed_out = True
                    kill_launch(proc, mark)
    finally:  # also when the test's own timeout interrupts the wait
        kill_launch(proc, mark)
    return Launch(out_dir, proc.returncode, stdout, stderr, timed_out)


def launch_scenarios(script, out_dir, scenarios, *args, **kwargs):
    """One launch of ``script OUT_DIR S1,S2,... *ARGS``."""
    return launch(script, out_dir, out_dir, ','.join(scenarios), *args,
                  **kwargs)


def assert_launch_succeeded(run, scenarios=None):
    """The launch exited cleanly, teardown included, and left a folder for
    each of ``scenarios`` (if given) and no other."""
    assert run.returncode == 0 and not run.timed_out, run.tail()
    if scenarios is not None:
        assert sorted(path.name for path in run.out_dir.iterdir()) == sorted(
            scenarios)
