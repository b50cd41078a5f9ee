"""One rank of a data-parallel fit; started by tests/test_distributed.py
with ``torchrun --nproc_per_node 2``.

Usage: ddp_worker.py OUT_DIR SCENARIO, where SCENARIO is ``samples`` (a
classifier, partial last group), ``tokens`` (a token-level loss whose item
counts differ between ranks), ``accelerate`` (skorch's AccelerateMixin
composed with GradAccMixin) or ``raise`` (rank 1 fails in its first step).
Each rank saves its parameters and counters to OUT_DIR/rank{r}.pt.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from skorch import NeuralNetClassifier  # noqa: E402
from test_normalization import IGNORE, TokenTagger, token_data  # noqa: E402

from skorch_gradacc import (  # noqa: E402
    GradAccMixin,
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
)
from skorch_gradacc.distributed import DistributedGradAccMixin  # noqa: E402

from conftest import MLPClassifier, classification_data  # noqa: E402

BATCH_SIZE, ACC_STEPS = 8, 3


class DDPClassifier(DistributedGradAccMixin, GradAccNeuralNetClassifier):
    pass


class DDPTokenNet(DistributedGradAccMixin, GradAccNeuralNet):
    def count_loss_items(self, batch):
        _, y = batch
        return int((y != IGNORE).sum())


class FailingMLP(MLPClassifier):
    def forward(self, X):
        raise RuntimeError('rank 1 fails on purpose')


class NLLOfProbabilities:
    """NLLLoss on probabilities, as NeuralNetClassifier computes it, but not
    a torch Module: skorch's AccelerateMixin would wrap a criterion Module in
    DDP, which refuses modules without parameters."""

    def __call__(self, y_pred, y_true):
        eps = torch.finfo(y_pred.dtype).eps
        return torch.nn.functional.nll_loss(torch.log(y_pred + eps), y_true)


def make_accelerated_net(**common):
    from accelerate import Accelerator
    from skorch.hf import AccelerateMixin

    class AcceleratedGradAccNet(AccelerateMixin, GradAccMixin,
                                NeuralNetClassifier):
        pass

    return AcceleratedGradAccNet(
        MLPClassifier, accelerator=Accelerator(cpu=True), device=None,
        criterion=NLLOfProbabilities, callbacks__print_log__sink=print,
        lr=0.1, **common)


def make_net(scenario, rank):
    common = dict(batch_size=BATCH_SIZE, acc_steps=ACC_STEPS, max_epochs=2,
                  train_split=None, verbose=0, optimizer__momentum=0.9)
    if scenario == 'tokens':
        return DDPTokenNet(
            TokenTagger, criterion=torch.nn.CrossEntropyLoss,
            criterion__ignore_index=IGNORE, lr=0.5, **common)
    if scenario == 'accelerate':
        return make_accelerated_net(**common)
    module = FailingMLP if scenario == 'raise' and rank == 1 else MLPClassifier
    return DDPClassifier(module, lr=0.1, **common)


def main(out_dir, scenario):
    if scenario != 'accelerate':  # the accelerator sets up the processes
        dist.init_process_group('gloo')
    X, y = {'tokens': lambda: token_data(100),
            'accelerate': lambda: classification_data(192)}.get(
                scenario, lambda: classification_data(202))()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = make_net(scenario, dist.get_rank() if dist.is_initialized() else 0)
    rank = dist.get_rank()
    net.fit(X, y)
    module = net.module_
    module = getattr(module, 'module', module)  # unwrap DDP
    torch.save({
        'params': module.state_dict(),
        'allreduces': net.comm_state_.allreduces,
        'steps': sum(net.history[:, 'train_batch_count']),
        'micro_batches': sum(-(-row['train_batch_size'] // BATCH_SIZE)
                             for row in net.history[:, 'batches'][0]
                             + net.history[:, 'batches'][1]),
    }, Path(out_dir) / 'rank{}.pt'.format(rank))
    # the comm hook runs no Python code on gloo's threads: nothing is left
    # to free there when the process exits
    dist.destroy_process_group()


if __name__ == '__main__':
    main(*sys.argv[1:3])
