"""Start a worker of tests/torchrun_scripts under torchrun, and read what
each scenario left (see torchrun_scripts/worker_common.py).

Starting torchrun and its ranks, each importing torch and skorch, takes
seconds, far longer than the small fits the tests run: a module launches
once with every scenario its tests need (a module-scoped fixture), and each
test reads its own scenario's outputs with :meth:`Launch.ranks`.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORLD_SIZE = 2
TIME_LIMIT = 240
TAIL = 3000


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

    def tail(self):
        return 'launch {}:\n{}{}'.format(
            'timed out' if self.timed_out else
            'exited with {}'.format(self.returncode),
            self.stdout[-TAIL:], self.stderr[-TAIL:])

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


def launch(script, out_dir, *args, nproc=WORLD_SIZE, options=('--standalone',),
           env=None, cwd=None, timeout=TIME_LIMIT):
    """Run ``torchrun OPTIONS --nproc_per_node NPROC SCRIPT *ARGS``.

    A launch that runs past ``timeout`` is killed with all its ranks (they
    share a new session) and returned with ``timed_out``.
    """
    env = dict(os.environ, OMP_NUM_THREADS='1', **(env or {}))
    command = [sys.executable, '-m', 'torch.distributed.run', *options,
               '--nproc_per_node', str(nproc), str(script),
               *[str(arg) for arg in args]]
    proc = subprocess.Popen(command, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
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
