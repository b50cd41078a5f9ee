"""One rank of a data-parallel fit with validation and scoring; started by
tests/test_sharded_evaluation.py under ``torchrun``.

Usage: eval_worker.py OUT_DIR ENGINE, ENGINE ``ddp``, ``fsdp`` or
``fsdp-micro`` (FSDP with ``micro_batch_size=3``: evaluation in pieces). A
classifier trains on 195 rows for 2 epochs (``batch_size=8``,
``acc_steps=3``) with 61 validation rows in batches of 7 (9 batches, uneven
over the ranks), scored by ``EpochScoring`` with and without caching and by
``BatchScoring``; then ``predict`` and ``predict_proba`` on the validation
rows. The module counts the rows and forward passes it evaluates. Each rank
saves its history, predictions and counts to OUT_DIR/rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from skorch.callbacks import BatchScoring, EpochScoring  # noqa: E402
from skorch.dataset import Dataset  # noqa: E402
from skorch.helper import predefined_split  # noqa: E402

from skorch_gradacc import GradAccNeuralNetClassifier  # noqa: E402
from skorch_gradacc.distributed import (  # noqa: E402
    DistributedGradAccMixin,
    FullyShardedGradAccMixin,
)

from conftest import MLPClassifier, classification_data  # noqa: E402

N_TRAIN, N_VALID, VALID_BATCH = 195, 61, 7


class CountingMLP(MLPClassifier):
    """Counts the rows and passes it evaluates (not in training)."""

    eval_rows = eval_passes = 0

    def forward(self, X):
        if not self.training:
            CountingMLP.eval_rows += len(X)
            CountingMLP.eval_passes += 1
        return super().forward(X)


def scoring():
    return [
        EpochScoring('accuracy', lower_is_better=False, name='valid_accuracy'),
        EpochScoring('neg_log_loss', use_caching=False, name='valid_nll'),
        BatchScoring('accuracy', lower_is_better=False, name='valid_bacc'),
    ]


def data():
    X, y = classification_data(N_TRAIN + N_VALID)
    return X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:]


def net_kwargs():
    X, y, X_valid, y_valid = data()
    return dict(module=CountingMLP, lr=0.1, optimizer__momentum=0.9,
                train_split=predefined_split(Dataset(X_valid, y_valid)),
                iterator_valid__batch_size=VALID_BATCH, callbacks=scoring(),
                verbose=0)


class DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier):
    pass


class FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    pass


def main(out_dir, engine):
    dist.init_process_group('gloo')
    X, y, X_valid, _ = data()
    torch.manual_seed(0)  # the same initial weights on every rank
    net_cls = DDPNet if engine == 'ddp' else FSDPNet
    micro = {'micro_batch_size': 3} if engine == 'fsdp-micro' else {}
    net = net_cls(batch_size=8, acc_steps=3, max_epochs=2, **micro,
                  **net_kwargs())
    net.fit(X, y)
    torch.save({
        'history': net.history.to_list(),
        'predict': net.predict(X_valid),
        'predict_proba': net.predict_proba(X_valid),
        'eval_rows': CountingMLP.eval_rows,
        'eval_passes': CountingMLP.eval_passes,
    }, Path(out_dir) / 'rank{}.pt'.format(dist.get_rank()))
    dist.barrier()  # no rank tears down while another still talks
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)


if __name__ == '__main__':
    main(*sys.argv[1:3])
