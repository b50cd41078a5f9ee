"""One rank of data-parallel fits with validation and scoring, for
tests/test_sharded_evaluation.py: ``eval_worker:ENGINE`` scenarios of
test_fully_sharded.py's launch (worker_common.py), or on its own.

Usage: eval_worker.py OUT_DIR ENGINES, a comma-separated list of ``ddp``,
``fsdp`` and ``fsdp-micro`` (FSDP with ``micro_batch_size=3``: evaluation in
pieces), run one after another (see worker_common.py). For each, a
classifier trains on 195 rows for 2 epochs (``batch_size=8``,
``acc_steps=3``) with 61 validation rows in batches of 7 (9 batches, uneven
over the ranks), scored by ``EpochScoring`` with and without caching and by
``BatchScoring``, and on the training batches (rank 1 has none in the last
step), with a ``ProgressBar``; then ``predict`` and ``predict_proba`` on the
validation rows. The module counts the rows and forward passes it evaluates. Each rank
saves its history, predictions and counts to OUT_DIR/ENGINE/rank{r}.pt.
"""

import sys

from skorch.callbacks import BatchScoring, Callback, EpochScoring, ProgressBar
from skorch.dataset import Dataset
from skorch.helper import predefined_split
from worker_common import run_scenarios, save_rank  # puts tests/ on sys.path

# isort: split
from skorch_gradacc import (
    DistributedGradAccMixin,
    FullyShardedGradAccMixin,
    GradAccNeuralNetClassifier,
)

from conftest import MLPClassifier, classification_data

N_TRAIN, N_VALID, VALID_BATCH = 195, 61, 7


class CountingMLP(MLPClassifier):
    """Counts the rows and passes it evaluates (not in training)."""

    eval_rows = eval_passes = 0

    def forward(self, X):
        if not self.training:
            CountingMLP.eval_rows += len(X)
            CountingMLP.eval_passes += 1
        return super().forward(X)


class BarTotal(Callback):
    """Records the steps the ProgressBar expects in the epoch."""

    train_batch_reads = ()

    def on_epoch_end(self, net, **kwargs):
        net.history.record('bar_total', dict(net.callbacks_)['progressbar'].pbar_.total)


def scoring():
    return [
        EpochScoring('accuracy', lower_is_better=False, name='valid_accuracy'),
        EpochScoring('neg_log_loss', use_caching=False, name='valid_nll'),
        BatchScoring('accuracy', lower_is_better=False, name='valid_bacc'),
        EpochScoring('accuracy', on_train=True, name='train_accuracy'),
        BatchScoring('accuracy', on_train=True, name='train_bacc'),
        ('progressbar', ProgressBar()), BarTotal(),
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


def run(engine, out_dir):
    X, y, X_valid, _ = data()
    CountingMLP.eval_rows = CountingMLP.eval_passes = 0
    net_cls = DDPNet if engine == 'ddp' else FSDPNet
    micro = {'micro_batch_size': 3} if engine == 'fsdp-micro' else {}
    net = net_cls(batch_size=8, acc_steps=3, max_epochs=2, **micro,
                  **net_kwargs())
    net.fit(X, y)
    save_rank({
        'history': net.history.to_list(),
        'predict': net.predict(X_valid),
        'predict_proba': net.predict_proba(X_valid),
        'eval_rows': CountingMLP.eval_rows,
        'eval_passes': CountingMLP.eval_passes,
    }, out_dir)


if __name__ == '__main__':
    run_scenarios(sys.argv[1], sys.argv[2], run)
