"""The harness of the torchrun tests (tests/torchrun_launch.py) fails a hang
fast, names it, and leaves no process behind.

torchrun starts each worker in a session of its own; tests/torchrun_scripts/
hang_worker.py also starts a process in yet another session, which holds
the launch's output pipes.
"""

import os
import time
from pathlib import Path

import pytest
from torchrun_launch import SCENARIO_LIMIT, launch, launch_scenarios

from conftest import background, background_folder, background_result

WORKER = Path(__file__).parent / 'torchrun_scripts' / 'hang_worker.py'
LIMIT = 10  # seconds, for the scenario that hangs
# what a launch takes on a loaded machine besides its scenarios (torchrun
# and the ranks start, import torch and tear down)
START_AND_STOP = 60
# seconds before a launch that hangs as it starts is killed: torchrun and
# its ranks start within the first on a quiet machine; the others are for
# a loaded one
TIMEOUTS = (6, 15, 30)


def launched_pids(out_dir):
    """The ids of the ranks that got to the hang and of the processes they
    started."""
    return [int(pid) for path in Path(out_dir).glob('pids-rank*.txt')
            for pid in path.read_text().split()]


def alive(pid):
    try:
        with open('/proc/{}/stat'.format(pid)) as file:
            return file.read().rpartition(')')[2].split()[0] != 'Z'
    except FileNotFoundError:
        return False


def assert_all_gone(pids):
    # a killed process is gone once its new parent has reaped it
    for _ in range(50):
        if not any(alive(pid) for pid in pids):
            return
        time.sleep(0.1)
    pytest.fail('processes of the launch still alive: {}'.format(
        [pid for pid in pids if alive(pid)]))


def test_the_scenario_limit_fails_a_hang_within_two_minutes():
    assert SCENARIO_LIMIT + START_AND_STOP <= 150


def run_hanging_scenario():
    """A launch whose second scenario hangs, in the background from the
    collection's end (conftest.py), where its wait overlaps the tests: its
    folder, the launch and the seconds it took."""
    folder, start = background_folder('hang'), time.monotonic()
    run = launch_scenarios(WORKER, folder, ['quick', 'hang', 'after'],
                           scenario_limit=LIMIT)
    return folder, run, time.monotonic() - start


@pytest.mark.slow  # torchrun
@pytest.mark.skipif(not os.path.isdir('/proc'), reason='needs /proc')
@background(run_hanging_scenario)
def test_a_hanging_scenario_fails_fast_by_name():
    folder, run, took = background_result(run_hanging_scenario)
    assert not run.timed_out, run.tail()
    assert run.returncode != 0
    assert took < LIMIT + START_AND_STOP, run.tail()
    pids = launched_pids(folder)
    assert len(pids) == 4  # both ranks got to the hang
    assert_all_gone(pids)
    run.ranks('quick')  # the scenario before it is intact
    with pytest.raises(pytest.fail.Exception) as failed:
        run.ranks('hang')
    message = str(failed.value)
    assert "scenario 'hang' ran past its limit of 10 s on rank" in message
    assert 'in hang' in message  # where it waits: the stack
    assert "scenario 'hang' ran past" in run.tail()  # the launch's own test
    assert not (folder / 'after').exists()


def run_past_timeouts():
    """Launches whose ranks hang as they start, in the background as
    :func:`run_hanging_scenario`: a short timeout, and a longer one only if
    it ran out before both ranks got to the hang (torchrun alone imports
    torch). For each, the launch, the seconds it took, and the ids of its
    processes, each gone when checked right after it."""
    launches = []
    for timeout in TIMEOUTS:
        out_dir, start = background_folder('timeout'), time.monotonic()
        run = launch(WORKER, out_dir, out_dir, 'setup', scenario_limit=None,
                     timeout=timeout)
        took, pids = time.monotonic() - start, launched_pids(out_dir)
        assert_all_gone(pids)
        launches.append((run, took, timeout, pids))
        if len(pids) == 4:  # both ranks got to the hang
            break
    return launches


@pytest.mark.slow  # torchrun
@pytest.mark.skipif(not os.path.isdir('/proc'), reason='needs /proc')
@background(run_past_timeouts)
def test_a_launch_past_its_timeout_leaves_no_process():
    # the ranks hang outside any scenario, with no limit of their own, as
    # soon as they start: each launch is killed with every process it
    # started by then
    launches = background_result(run_past_timeouts)
    for run, took, timeout, _ in launches:
        assert run.timed_out
        assert took < timeout + START_AND_STOP
    assert len(launches[-1][-1]) == 4, 'the ranks never started within {} s'.format(
        TIMEOUTS[-1])
