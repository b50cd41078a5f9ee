"""One rank of a data-parallel fit of a token-level loss with no
``count_loss_items`` override; started by tests/test_loss_items.py with
``torchrun --nproc_per_node 2``.

Usage: ddp_default_counts.py OUT_DIR CASE, where CASE names the criterion's
parameters in CASES. Each rank saves its parameters and history to
OUT_DIR/rank{r}.pt.
"""

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_normalization import IGNORE, VOCAB, TokenTagger, token_data  # noqa: E402

from skorch_gradacc import GradAccNeuralNet, LossItemsWarning  # noqa: E402
from skorch_gradacc.distributed import DistributedGradAccMixin  # noqa: E402

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


def main(out_dir, case):
    dist.init_process_group('gloo')
    warnings.simplefilter('error', LossItemsWarning)
    X, y = token_data(100)
    torch.manual_seed(0)
    net = DDPNet(TokenTagger, criterion=torch.nn.CrossEntropyLoss,
                 criterion__ignore_index=IGNORE, batch_size=BATCH_SIZE,
                 acc_steps=ACC_STEPS, max_epochs=2, lr=0.5, train_split=None,
                 verbose=0, **CASES[case])
    net.fit(X, y)
    torch.save({'params': net.module_.module.state_dict(),
                'train_loss': [float(v) for v in net.history[:, 'train_loss']]},
               Path(out_dir) / 'rank{}.pt'.format(dist.get_rank()))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
