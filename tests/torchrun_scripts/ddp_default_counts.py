"""One rank of data-parallel fits of a token-level loss with no
``count_loss_items`` override, for tests/test_loss_items.py:
``ddp_default_counts:CASE`` scenarios of test_distributed.py's launch
(worker_common.py), or on its own.

Usage: ddp_default_counts.py OUT_DIR CASES, a comma-separated list of the
criterion's parameters in CASES (run one after another, see
worker_common.py). Each rank saves its parameters and history to
OUT_DIR/CASE/rank{r}.pt.
"""

import sys
import warnings

import torch
from worker_common import run_scenarios, save_rank  # puts tests/ on sys.path

# isort: split
from test_normalization import IGNORE, VOCAB, TokenTagger, token_data

from skorch_gradacc import GradAccNeuralNet, LossItemsWarning
from skorch_gradacc.distributed import DistributedGradAccMixin

BATCH_SIZE, ACC_STEPS = 4, 3
CASES = {
    'ignore_index': {},
    'weight_smoothing': {
        'criterion__weight': torch.linspace(0.5, 2.0, VOCAB,
                                            dtype=torch.float64),
        'criterion__label_smoothing': 0.1},
}


class DDPNet(DistributedGradAccMixin, GradAccNeuralNet):
    pass


def run(case, out_dir):
    X, y = token_data(100)
    net = DDPNet(TokenTagger, criterion=torch.nn.CrossEntropyLoss,
                 criterion__ignore_index=IGNORE, batch_size=BATCH_SIZE,
                 acc_steps=ACC_STEPS, max_epochs=2, lr=0.5, train_split=None,
                 verbose=0, **CASES[case])
    with warnings.catch_warnings():  # the counts need no override
        warnings.simplefilter('error', LossItemsWarning)
        net.fit(X, y)
    save_rank({'params': net.module_.module.state_dict(),
               'train_loss': [float(v) for v in net.history[:, 'train_loss']]},
              out_dir)


def main(out_dir, cases):
    run_scenarios(out_dir, cases, run)


if __name__ == '__main__':
    main(*sys.argv[1:3])
