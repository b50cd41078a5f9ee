"""One rank of a data-parallel fit whose gradient all-reduce must overlap
the backward; started by tests/test_overlap.py with ``torchrun
--nproc_per_node 2``.

Usage: overlap_worker.py OUT_DIR. In the first step of a fit, rank 1's
backward that all-reduces pauses for ``DELAY`` seconds after the output
layer's bucket is ready, before the hidden layers' one. Rank 0 records
how long each call of the engine's communication hook took and in which
thread DDP's futures were completed:
a hook that waited for its all-reduce would wait out rank 1's pause.
A second fit runs with ``mixed_precision='fp16'``.

Each rank saves its records and the fit's parameters to
OUT_DIR/rank{r}.pt, and returns from Python without tearing the process
group down or skipping the interpreter's exit: a callback left on a
communication thread would abort it.
"""

import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from skorch_gradacc import GradAccNeuralNetRegressor, engine  # noqa: E402
from skorch_gradacc.distributed import DistributedGradAccMixin  # noqa: E402

from conftest import DTYPE, regression_data  # noqa: E402

BATCH_SIZE, ACC_STEPS, N_SAMPLES, DELAY = 8, 2, 100, 0.5


class PauseOnRankOne(torch.nn.Module):
    """The identity; rank 1's first backward that all-reduces pauses here.

    ``syncs`` (set by :class:`DDPNet`) says whether the coming backward
    all-reduces; unset, the module never pauses.
    """

    syncs, paused = None, False

    def forward(self, X):
        if (X.requires_grad and self.syncs is not None and self.syncs()
                and dist.get_rank() == 1 and not self.paused):
            self.paused = True
            X.register_hook(lambda grad: time.sleep(DELAY))
        return X


def module():
    return torch.nn.Sequential(
        torch.nn.Linear(10, 256, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(256, 256, dtype=DTYPE), PauseOnRankOne(),
        torch.nn.Linear(256, 1, dtype=DTYPE))


def fp16_module():
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


class DDPNet(DistributedGradAccMixin, GradAccNeuralNetRegressor):

    def initialize_module(self):
        super().initialize_module()
        ddp = self.module_
        for layer in ddp.modules():
            if isinstance(layer, PauseOnRankOne):
                layer.syncs = lambda: ddp.require_backward_grad_sync
        return self


def timed_hook(hook, calls):
    """The engine's hook, timed; notes the thread completing its future."""
    def timed(state, bucket):
        start = time.perf_counter()
        future = hook(state, bucket)
        record = {'seconds': time.perf_counter() - start,
                  'done_at_return': future.done()}
        calls.append(record)
        future.add_done_callback(
            lambda _: record.update(thread=threading.get_ident()))
        return future
    return timed


def main(out_dir):
    dist.init_process_group('gloo')
    X, y = regression_data(N_SAMPLES)
    calls, hook = [], engine._scaled_allreduce_hook
    engine._scaled_allreduce_hook = timed_hook(hook, calls)
    torch.manual_seed(0)
    net = DDPNet(module, acc_steps=ACC_STEPS, batch_size=BATCH_SIZE,
                 max_epochs=2, lr=0.05, train_split=None, verbose=0)
    net.fit(X, y)
    # fp16: each rank's unit is its first count, which the hook multiplies
    engine._scaled_allreduce_hook = timed_hook(hook, [])
    torch.manual_seed(0)
    fp16 = DDPNet(fp16_module, acc_steps=ACC_STEPS, batch_size=BATCH_SIZE,
                  max_epochs=2, lr=0.05, train_split=None, verbose=0,
                  mixed_precision='fp16').fit(X.astype('float32'),
                                              y.astype('float32'))
    torch.save({
        'fp16_params': fp16.module_.module.state_dict(),
        'fp16_unit': fp16.engine_.count_unit,
        'fp16_skipped': fp16.history[:, 'skipped_steps'],
        'calls': calls,
        'main_thread': threading.get_ident(),
        'allreduces': net.engine_.allreduces,
        'params': net.module_.module.state_dict(),
        'train_losses': [float(loss) for loss in net.history[:, 'train_loss']],
    }, Path(out_dir) / 'rank{}.pt'.format(dist.get_rank()))
    dist.barrier()


if __name__ == '__main__':
    main(sys.argv[1])
