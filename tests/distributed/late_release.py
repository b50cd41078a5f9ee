"""Run a script as ``__main__`` with DDP's hook callbacks released late.

Usage: ``torchrun ... late_release.py SCRIPT [ARGS]``. Every communication
hook registered on a DistributedDataParallel module is wrapped: its future
gets one more Python callback, which runs on a gloo worker thread and is
freed there. That release waits until the hook is called again, or for
``DELAY`` seconds when it is not (after the fit's last all-reduce, and
here after each epoch's). On a busy machine the thread can be descheduled
for a while at that point; a rank that exits meanwhile aborts with
``terminate called without an active exception``, since the thread cannot
take the GIL of an interpreter that is shutting down. A script whose
process group's work is done before it exits (DistributedGradAccMixin's
barrier at the end of ``fit``) passes; this makes the race certain.
"""

import os
import runpy
import sys
import time

from torch.nn.parallel import DistributedDataParallel

DELAY = 1.0  # seconds
hook_calls = 0


class ReleasedLate:
    """A callback that passes the value on, and takes long to be freed."""

    def __init__(self):
        self.call = hook_calls

    def __call__(self, future):
        return future.value()

    def __del__(self):
        start = time.monotonic()
        while hook_calls == self.call and time.monotonic() - start < DELAY:
            time.sleep(0.01)  # releases the GIL
        if hook_calls == self.call:
            print('rank {} released a callback late'.format(
                os.environ['RANK']), flush=True)


def register_comm_hook(self, state, hook):
    def late_hook(state, bucket):
        global hook_calls
        hook_calls += 1
        return hook(state, bucket).then(ReleasedLate())

    return original_register_comm_hook(self, state, late_hook)


original_register_comm_hook = DistributedDataParallel.register_comm_hook

if __name__ == '__main__':
    # only when run as the script: pytest imports this module to collect
    # doctests, and DDP must stay unpatched there
    DistributedDataParallel.register_comm_hook = register_comm_hook
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name='__main__')
