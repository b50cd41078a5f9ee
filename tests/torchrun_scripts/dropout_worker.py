"""One rank of data-parallel fits of a module with dropout, for
tests/test_rank_streams.py: ``dropout_worker:ENGINE`` scenarios of
test_fully_sharded.py's launch (worker_common.py), or on its own.

Usage: dropout_worker.py OUT_DIR ENGINES, a comma-separated list of ``ddp``
and ``fsdp``, run one after another (see worker_common.py). For each, a
classifier with ``Dropout(0.5)`` trains on 195 shuffled rows for 2 epochs,
``batch_size=8``, ``acc_steps=3``; the first column of X is the row's id.
Each rank saves, per training forward pass, the ids of its rows and its
dropout mask to OUT_DIR/ENGINE/rank{r}.pt.
"""

import sys

import numpy as np
import torch
from worker_common import run_scenarios, save_rank  # puts tests/ on sys.path

# isort: split
from skorch_gradacc import (
    DistributedGradAccMixin,
    FullyShardedGradAccMixin,
    GradAccNeuralNetClassifier,
)

from conftest import DTYPE, classification_data

SEEN = []
PADDING = [False]  # whether the pass pads a rank (2 rows of a batch of its)


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16, dtype=DTYPE)
        self.dropout = torch.nn.Dropout(0.5)
        self.output = torch.nn.Linear(16, 3, dtype=DTYPE)

    def forward(self, X):
        ids, X = X[:, 0], X[:, 1:]
        hidden = self.dropout(torch.tanh(self.hidden(X)))
        if self.training and not PADDING[0]:
            SEEN.append((ids.long().tolist(), (hidden == 0).tolist()))
        return torch.softmax(self.output(hidden), dim=-1)


class NotesPadding:
    def infer(self, x, **fit_params):
        PADDING[0] = getattr(x, 'stand_in_', None) is not None  # padding_batch's
        return super().infer(x, **fit_params)


class DDPNet(NotesPadding, DistributedGradAccMixin, GradAccNeuralNetClassifier):
    pass


class FSDPNet(NotesPadding, FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    pass


def run(engine, out_dir):
    SEEN.clear()
    X, y = classification_data(195)
    X = np.hstack([np.arange(len(X))[:, None].astype(X.dtype), X])
    net_cls = DDPNet if engine == 'ddp' else FSDPNet
    net = net_cls(DropoutMLP, batch_size=8, acc_steps=3, max_epochs=2,
                  lr=0.1, iterator_train__shuffle=True, train_split=None,
                  verbose=0)
    net.fit(X, y)
    save_rank(list(SEEN), out_dir)


if __name__ == '__main__':
    # the same weights and random state on every rank (seeded by
    # run_scenarios before each engine)
    run_scenarios(sys.argv[1], sys.argv[2], run)
