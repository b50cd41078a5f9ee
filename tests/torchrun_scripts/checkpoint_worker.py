"""One rank of data-parallel fits with skorch's checkpoints; started by
tests/test_checkpoints.py under ``torchrun``.

Usage: checkpoint_worker.py OUT_DIR FITS ACC_STEPS EPOCHS, where FITS is a
comma-separated list of fits ``ENGINE[:MODE]`` that run in turn, ENGINE
``ddp`` or ``fsdp``. A launch of one fit writes to OUT_DIR (the tests
resume, restart and change the world size across launches); of several,
fit i writes to OUT_DIR/i, and its crash (below) comes in torchrun's
attempt i: attempt i + 1 resumes it, after the fits done (their rank files
are there), and then starts the next. So one launch, whose start-up takes
seconds, serves several restarts.

A regressor trains on 195 rows with 61 validation rows, ``batch_size=8``,
with ``Checkpoint(monitor=None)`` and ``LoadInitState`` in the fit's
folder's cp: a run resumes from the files there, and trains until the
history holds EPOCHS epochs (``fit(epochs=...)``, as docs/scaling_out.rst
says). MODE is

* ``train`` (default);
* ``rank0``: then ``if rank == 0: net.save_params(...)``, with a short
  ``rank_wait_timeout``; its error, if any, is saved;
* ``crash``: rank 1 exits with ``os._exit(1)`` in the second step of epoch
  4, in the fit's attempt only (``TORCHELASTIC_RESTART_COUNT``);
* ``crash_shuffle``: the same with ``iterator_train__shuffle=True`` and
  dropout (p=0.3);
* ``crash_sgd``: the same as ``crash`` without momentum: the optimizer
  (skorch's default SGD) holds no state;
* ``train_shuffle``: ``crash_shuffle`` uninterrupted.

After the fit (but in ``rank0``), every rank calls ``save_params`` and then
``load_params``
into a new net, whose parameters it saves, and whose lr (set to another
one first) is the file's; rank 0 waits 1 s before it writes the
parameters, so a ``load_params`` that did not wait for the ranks would
read before the file is there.

Each rank saves its files written (``torch.save`` calls), history,
restart count and the new net's lr to the fit's folder's rank{r}.pt.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from skorch.callbacks import Callback, Checkpoint, LoadInitState
from skorch.dataset import Dataset
from skorch.helper import predefined_split
from skorch.history import History
from worker_common import finish, save_rank  # puts tests/ on sys.path

# isort: split
from skorch_gradacc import DistributedGradAccMixin, GradAccNeuralNetRegressor

from conftest import MLPRegressor, regression_data

N_TRAIN, N_VALID, BATCH_SIZE = 195, 61, 8
SAVES = []
SLOW_SAVES = []  # non-empty: rank 0 waits 1 s before final_params.pt
_torch_save = torch.save


def counting_save(obj, f, *args, **kwargs):
    SAVES.append(os.path.basename(str(f)))
    if SLOW_SAVES and dist.get_rank() == 0 and SAVES[-1].startswith(
            'final_params.pt'):
        time.sleep(1)
    return _torch_save(obj, f, *args, **kwargs)


torch.save = counting_save  # skorch's save_params looks it up at each call


class DDPRegressor(DistributedGradAccMixin, GradAccNeuralNetRegressor):
    pass


def fsdp_regressor():
    """The FSDP2 regressor class; FSDP2 is imported only by the launches that
    use it: the import takes a good part of a rank's start-up."""
    from skorch_gradacc import FullyShardedGradAccMixin

    class FSDPRegressor(FullyShardedGradAccMixin, GradAccNeuralNetRegressor):
        pass

    return FSDPRegressor


class DropoutRegressor(MLPRegressor):
    """MLPRegressor with dropout (p=0.3) on its hidden layer."""

    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.3)

    def forward(self, X):
        return self.output(self.dropout(torch.tanh(self.hidden(X))))


class CrashInEpoch4(Callback):
    """Rank 1 dies in the second step of epoch 4, in torchrun's ``attempt``."""

    def __init__(self, attempt):
        self.attempt = attempt

    def on_epoch_begin(self, net, **kwargs):
        self.steps_ = 0

    def on_batch_end(self, net, training=False, **kwargs):
        self.steps_ += training
        if (training and len(net.history) == 4 and self.steps_ == 2
                and dist.get_rank() == 1
                and os.environ.get('TORCHELASTIC_RESTART_COUNT')
                == str(self.attempt)):
            sys.stdout.flush()
            os._exit(1)


def data():
    X, y = regression_data(N_TRAIN + N_VALID)
    return X[:N_TRAIN], y[:N_TRAIN], Dataset(X[N_TRAIN:], y[N_TRAIN:])


def main(out_dir, fits, acc_steps, epochs):
    dist.init_process_group('gloo')
    fits = fits.split(',')
    chained = len(fits) > 1
    for attempt, fit in enumerate(fits):
        folder = Path(out_dir) / str(attempt) if chained else Path(out_dir)
        if chained and (folder / 'rank{}.pt'.format(dist.get_rank())).exists():
            continue  # done in an earlier attempt
        folder.mkdir(exist_ok=True)
        engine, _, mode = fit.partition(':')
        train(folder, engine, int(acc_steps), int(epochs), mode or 'train',
              attempt)
    finish()


def train(out_dir, engine, acc_steps, epochs, mode, attempt):
    """One fit, and its rank's results in ``out_dir``."""
    SAVES.clear()
    rank = dist.get_rank()
    X, y, valid = data()
    cp = Checkpoint(dirname=str(out_dir / 'cp'), monitor=None)
    callbacks = [cp, LoadInitState(cp)]
    if mode.startswith('crash'):
        callbacks.append(CrashInEpoch4(attempt))
    net_cls = DDPRegressor if engine == 'ddp' else fsdp_regressor()
    shuffle = mode.endswith('_shuffle')
    momentum = 0 if mode == 'crash_sgd' else 0.9
    torch.manual_seed(0)  # the same initial weights on every rank

    def make_net(**kwargs):
        return net_cls(DropoutRegressor if shuffle else MLPRegressor,
                       batch_size=BATCH_SIZE, acc_steps=acc_steps,
                       lr=0.05, optimizer__momentum=momentum,
                       train_split=predefined_split(valid),
                       iterator_train__shuffle=shuffle, verbose=0, **kwargs)

    net = make_net(callbacks=callbacks)
    # max_epochs counts the epochs of one fit: resume with those left
    done = (len(History.from_file(cp.f_history_))
            if os.path.exists(cp.f_history_) else 0)
    net.fit(X, y, epochs=epochs - done)
    error = None
    if mode == 'rank0' and rank == 0:
        # short: the other ranks never come. The default elsewhere, where
        # they all come, however loaded the machine
        net.rank_wait_timeout = 3
        try:
            net.save_params(f_params=out_dir / 'rank0_params.pt')
        except RuntimeError as exc:
            error = str(exc)
    loaded = None
    if mode != 'rank0':
        # every rank saves, rank 0 slowly, and loads what rank 0 wrote
        # (initialized first: DDP's wrapping waits for every rank)
        loaded = make_net().initialize()
        loaded.set_params(lr=1.0)  # the file's lr replaces it
        final = {'f_params': out_dir / 'final_params.pt',
                 'f_optimizer': out_dir / 'final_optimizer.pt'}
        SLOW_SAVES.append(True)
        net.save_params(**final)
        SLOW_SAVES.clear()
        loaded.load_params(**final)
    ddp = engine == 'ddp'
    save_rank({
        'params': net.module_.state_dict() if ddp else None,
        'loaded': loaded.module_.state_dict() if ddp and loaded else None,
        'saves': SAVES,
        'error': error,
        'restart': int(os.environ.get('TORCHELASTIC_RESTART_COUNT', -1)),
        'history': net.history.to_list(),
        'lr': loaded.optimizer_.param_groups[0]['lr'] if loaded else None,
    }, out_dir, save=_torch_save)


if __name__ == '__main__':
    main(*sys.argv[1:])
