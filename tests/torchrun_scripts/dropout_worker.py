"""One rank of a data-parallel fit of a module with dropout; started by
tests/test_rank_streams.py under ``torchrun``.

Usage: dropout_worker.py OUT_DIR ENGINE, ENGINE ``ddp`` or ``fsdp``. A
classifier with ``Dropout(0.5)`` trains on 195 shuffled rows for 2 epochs,
``batch_size=8``, ``acc_steps=3``; the first column of X is the row's id.
Each rank saves, per training forward pass, the ids of its rows and its
dropout mask to OUT_DIR/rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from skorch_gradacc import GradAccNeuralNetClassifier  # noqa: E402
from skorch_gradacc.distributed import (  # noqa: E402
    DistributedGradAccMixin,
    FullyShardedGradAccMixin,
)

from conftest import DTYPE, classification_data  # noqa: E402

SEEN = []


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16, dtype=DTYPE)
        self.dropout = torch.nn.Dropout(0.5)
        self.output = torch.nn.Linear(16, 3, dtype=DTYPE)

    def forward(self, X):
        ids, X = X[:, 0], X[:, 1:]
        hidden = self.dropout(torch.tanh(self.hidden(X)))
        if self.training and len(ids):
            SEEN.append((ids.long().tolist(), (hidden == 0).tolist()))
        return torch.softmax(self.output(hidden), dim=-1)


class DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier):
    pass


class FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    pass


def main(out_dir, engine):
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    X, y = classification_data(195)
    X = np.hstack([np.arange(len(X))[:, None].astype(X.dtype), X])
    torch.manual_seed(0)  # the same weights and random state on every rank
    net_cls = DDPNet if engine == 'ddp' else FSDPNet
    net = net_cls(DropoutMLP, batch_size=8, acc_steps=3, max_epochs=2,
                  lr=0.1, iterator_train__shuffle=True, train_split=None,
                  verbose=0)
    net.fit(X, y)
    torch.save(SEEN, Path(out_dir) / 'rank{}.pt'.format(rank))
    dist.barrier()  # no rank tears down while another still talks
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)


if __name__ == '__main__':
    main(*sys.argv[1:3])
