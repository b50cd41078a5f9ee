"""A worker that hangs, for the tests of the harness itself
(tests/test_torchrun_launch.py); started with ``torchrun --nproc_per_node 2``.

Usage: hang_worker.py OUT_DIR SCENARIOS, run one after another (see
worker_common.py), or hang_worker.py OUT_DIR setup, which hangs at once,
before it imports torch. In ``quick`` each rank saves its results; in
``hang`` (and ``setup``) each rank starts a process in a session of its own
that sleeps (as a server a user's code starts might), writes its and that
process's ids to OUT_DIR/pids-rank{r}.txt, then rank 1 sleeps while rank 0
waits for it in a barrier.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

SLEEP = [sys.executable, '-c', 'import time; time.sleep(3600)']


def hang(out_dir, barrier=None):
    sleeper = subprocess.Popen(SLEEP, start_new_session=True)
    (Path(out_dir) / 'pids-rank{}.txt'.format(os.environ['RANK'])).write_text(
        '{} {}\n'.format(os.getpid(), sleeper.pid))
    if os.environ['RANK'] == '1' or barrier is None:
        time.sleep(3600)
    barrier()


if __name__ == '__main__' and sys.argv[2] == 'setup':
    hang(sys.argv[1])

# isort: split
import torch.distributed as dist  # noqa: E402
from worker_common import run_scenarios, save_rank  # noqa: E402


def run(scenario, folder):
    if scenario == 'hang':
        hang(folder.parent, dist.barrier)
    save_rank({'scenario': scenario}, folder)


if __name__ == '__main__':
    run_scenarios(sys.argv[1], sys.argv[2], run)
