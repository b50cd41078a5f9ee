"""Run a script as ``__main__`` and watch where DDP's hook callbacks are freed.

Usage: ``torchrun ... late_release.py SCRIPT [ARGS]``. Every communication
hook registered on a DistributedDataParallel module is wrapped: its future
gets one more Python callback, which reports the thread that frees it. A
callback freed on one of gloo's worker threads can be freed after the step
has moved on; a rank that exits in that moment aborts with ``terminate
called without an active exception``, since the thread cannot take the GIL
of an interpreter that is shutting down. A hook whose future is completed
in the training thread (skorch_gradacc's, at the end of the backward) has
its callbacks run and freed there; the script prints a line for each one
freed elsewhere.
"""

import os
import runpy
import sys
import threading

from torch.nn.parallel import DistributedDataParallel


class WatchRelease:
    """A callback that passes the value on and reports where it is freed."""

    def __call__(self, future):
        return future.value()

    def __del__(self):
        if threading.current_thread() is not threading.main_thread():
            print('rank {} freed a hook callback on thread {}'.format(
                os.environ.get('RANK'), threading.current_thread().name),
                flush=True)


def register_comm_hook(self, state, hook):
    print('rank {} watches its comm hook'.format(os.environ.get('RANK')),
          flush=True)

    def watched_hook(state, bucket):
        return hook(state, bucket).then(WatchRelease())

    return original_register_comm_hook(self, state, watched_hook)


original_register_comm_hook = DistributedDataParallel.register_comm_hook

if __name__ == '__main__':
    # only when run as the script: pytest imports this module to collect
    # doctests, and DDP must stay unpatched there
    DistributedDataParallel.register_comm_hook = register_comm_hook
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name='__main__')
