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


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LIMIT + 2 * START_AND_STOP)
@pytest.mark.skipif(not os.path.isdir('/proc'), reason='needs /proc')
def test_a_hanging_scenario_fails_fast_by_name(tmp_path):
    start = time.monotonic()
    run = launch_scenarios(WORKER, tmp_path, ['quick', 'hang', 'after'],
                           scenario_limit=LIMIT)
    took = time.monotonic() - start
    assert not run.timed_out, run.tail()
    assert run.returncode != 0
    assert took < LIMIT + START_AND_STOP, run.tail()
    pids = launched_pids(tmp_path)
    assert len(pids) == 4  # both ranks got to the hang
    assert_all_gone(pids)
    run.ranks('quick')  # the scenario before it is intact
    with pytest.raises(pytest.fail.Exception) as failed:
        run.ranks('hang')
    message = str(failed.value)
    assert "scenario 'hang' ran past its limit of 10 s on rank" in message
    assert 'in hang' in message  # where it waits: the stack
    assert "scenario 'hang' ran past" in run.tail()  # the launch's own test
    assert not (tmp_path / 'after').exists()


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(sum(TIMEOUTS) + 2 * START_AND_STOP)
@pytest.mark.skipif(not os.path.isdir('/proc'), reason='needs /proc')
def test_a_launch_past_its_timeout_leaves_no_process(tmp_path):
    # the ranks hang outside any scenario, with no limit of their own, as
    # soon as they start. A short timeout, and a longer one only if it ran
    # out before both ranks got to the hang (torchrun alone imports torch):
    # each launch is killed with every process it started by then
    for timeout in TIMEOUTS:
        out_dir = tmp_path / str(timeout)
        out_dir.mkdir()
        start = time.monotonic()
        run = launch(WORKER, out_dir, out_dir, 'setup', scenario_limit=None,
                     timeout=timeout)
        assert run.timed_out
        assert time.monotonic() - start < timeout + START_AND_STOP
        pids = launched_pids(out_dir)
        assert_all_gone(pids)
        if len(pids) == 4:  # both ranks got to the hang
            break
    assert len(pids) == 4, 'the ranks never started within {} s'.format(
        TIMEOUTS[-1])
