"""One rank of a fully sharded (FSDP2) fit; started by
tests/test_fully_sharded.py with ``torchrun --nproc_per_node 2``.

Usage: fsdp_worker.py OUT_DIR SCENARIO, where SCENARIO is

* ``samples``: a classifier on 195 rows, micro-batches of 8,
  ``acc_steps=3``; rank 1 has no micro-batch in each epoch's last step;
* ``samples_each``: the same with ``sync_each_batch=True``;
* ``tokens``: a token-level loss whose item counts differ between ranks,
  shuffled, on 117 rows: in each epoch's last step rank 0 has two
  micro-batches and rank 1 one, and a zero-row pass;
* ``cuda``: ``samples`` on the GPUs, with NCCL (one rank per GPU);
* ``clip``: ``samples`` with skorch's GradientNormClipping;
* ``bf16``: ``samples`` with ``mixed_precision='bf16'``;
* ``resume``: ``samples`` for one epoch, ``save_params``, a new net that
  ``load_params`` and trains a second epoch.

Rank 0 saves the net's full checkpoint (``save_params``) and the history
to OUT_DIR; each rank saves its counters to OUT_DIR/rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from skorch.callbacks import GradientNormClipping

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from test_normalization import IGNORE, TokenTagger, token_data  # noqa: E402

from skorch_gradacc import (  # noqa: E402
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
)
from skorch_gradacc.distributed import FullyShardedGradAccMixin  # noqa: E402

from conftest import DTYPE, classification_data  # noqa: E402

BATCH_SIZE, ACC_STEPS, N_SAMPLES, N_TOKEN_SAMPLES = 8, 3, 195, 117
CLIP_NORM = 0.05


def sequential_classifier():
    """A plain Sequential: the default sharding makes each Linear a unit."""
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(16, 16, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(16, 3, dtype=DTYPE), torch.nn.Softmax(dim=-1))


class FSDPClassifier(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    pass


class FSDPTokenNet(FullyShardedGradAccMixin, GradAccNeuralNet):
    def count_loss_items(self, batch):
        _, y = batch
        return int((y != IGNORE).sum())


def make_net(scenario, max_epochs=2):
    common = dict(batch_size=BATCH_SIZE, acc_steps=ACC_STEPS,
                  max_epochs=max_epochs, train_split=None, verbose=0,
                  optimizer__momentum=0.9)
    if scenario == 'tokens':
        return FSDPTokenNet(
            TokenTagger, criterion=torch.nn.CrossEntropyLoss,
            criterion__ignore_index=IGNORE, lr=0.5,
            iterator_train__shuffle=True,
            shard_classes=[torch.nn.Embedding, 'Linear'], **common)
    if scenario == 'cuda':
        common['device'] = 'cuda:{}'.format(os.environ['LOCAL_RANK'])
    if scenario == 'clip':
        common['callbacks'] = [GradientNormClipping(CLIP_NORM)]
    return FSDPClassifier(
        sequential_classifier, lr=0.1,
        sync_each_batch=scenario == 'samples_each',
        mixed_precision='bf16' if scenario == 'bf16' else None, **common)


def fit(scenario, out_dir):
    if scenario == 'tokens':
        X, y = token_data(N_TOKEN_SAMPLES)
    else:
        X, y = classification_data(N_SAMPLES)
    torch.manual_seed(0)  # the same initial weights on every rank
    if scenario != 'resume':
        net = make_net(scenario).initialize()
        net.forward_dtypes_ = set()
        first_layer = next(module for module in net.module_.modules()
                           if isinstance(module, torch.nn.Linear))
        first_layer.register_forward_hook(
            lambda module, args, output: net.forward_dtypes_.add(output.dtype))
        return net.partial_fit(X, y)
    first = make_net(scenario, max_epochs=1).fit(X, y)
    first.save_params(f_params=out_dir / 'epoch1_params.pt',
                      f_optimizer=out_dir / 'epoch1_optimizer.pt',
                      f_history=out_dir / 'epoch1_history.json')
    torch.manual_seed(1)  # other initial weights: the checkpoint replaces them
    net = make_net(scenario, max_epochs=1).initialize()
    net.load_params(f_params=out_dir / 'epoch1_params.pt',
                    f_optimizer=out_dir / 'epoch1_optimizer.pt',
                    f_history=out_dir / 'epoch1_history.json')
    return net.partial_fit(X, y)


def main(out_dir, scenario):
    out_dir = Path(out_dir)
    dist.init_process_group('nccl' if scenario == 'cuda' else 'gloo')
    net = fit(scenario, out_dir)
    rank = dist.get_rank()
    net.save_params(f_params=out_dir / 'params.pt',
                    f_optimizer=out_dir / 'optimizer.pt',
                    f_history=out_dir / 'history.json')
    torch.save({
        'shard_numel': sum(param.to_local().numel()
                           for param in net.module_.parameters()),
        'max_memory_allocated': (torch.cuda.max_memory_allocated()
                                 if scenario == 'cuda' else None),
        'forward_dtypes': getattr(net, 'forward_dtypes_', None),
        'shard_dtypes': {param.dtype for param in net.module_.parameters()},
        'units': sum(isinstance(module, torch.distributed.fsdp.FSDPModule)
                     for module in net.module_.modules()),
        'train_losses': [row['train_loss']
                         for epoch in net.history[:, 'batches']
                         for row in epoch],
        'train_batch_sizes': [row['train_batch_size']
                              for epoch in net.history[:, 'batches']
                              for row in epoch],
    }, out_dir / 'rank{}.pt'.format(rank))
    dist.barrier()  # no rank tears down while another still talks
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)


if __name__ == '__main__':
    main(*sys.argv[1:3])
