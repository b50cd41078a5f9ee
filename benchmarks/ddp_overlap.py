"""A DDP training epoch of a GradAcc net against a hand-written loop.

    python -m benchmarks.ddp_overlap --out benchmark_results

runs this module under ``torchrun`` on 2 gloo ranks, one torch thread
each (:func:`benchmarks.harness.torchrun`). Both contenders train the same
MLP of 5.1 M parameters, ``acc_steps=4`` micro-batches of 64 rows per rank
and step, from the same skorch iterator (rank ``r`` loads micro-batches
``r, r + 2, ...``), with SGD:

* ``gradacc``: a ``DistributedGradAccMixin`` net's ``partial_fit``, whose
  engine all-reduces the gradient in its own hook
  (:class:`skorch_gradacc.engine.DDPEngine`);
* ``hand``: a loop written for DDP: ``no_sync()`` for all micro-batches
  of a step but the last, ``(loss / k).backward()``, DDP's default hook.

They take turns for ``--rounds`` epochs (:func:`benchmarks.harness.
interleave`); the ratios of rank 0's wall and CPU times are taken within
each round. Saved as ``ddp_overlap.json``, with the largest difference
between the two models' parameters at the end (float32).
"""

import contextlib
import itertools
import os
import sys

import torch
import torch.distributed as dist
from skorch.dataset import Dataset
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from benchmarks import harness
from benchmarks.workloads import mlp
from skorch_gradacc import DistributedGradAccMixin, GradAccNeuralNetClassifier

N_ROWS, N_FEATURES, HIDDEN, BATCH_SIZE, ACC_STEPS = 8192, 256, 1536, 64, 4


def module():
    torch.manual_seed(0)
    return mlp(N_FEATURES, HIDDEN, n_layers=3)


def time_epochs(rounds):
    """On each rank: time both contenders, return the times and the diff."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(N_ROWS, N_FEATURES, generator=generator)
    y = torch.randint(0, 10, (N_ROWS,), generator=generator)
    net = type('DDPNet', (DistributedGradAccMixin, GradAccNeuralNetClassifier), {})(
        module, criterion=torch.nn.CrossEntropyLoss, lr=0.01, acc_steps=ACC_STEPS,
        batch_size=BATCH_SIZE, max_epochs=1, train_split=None, verbose=0,
        check_loss=False).initialize()  # the check runs once per fit

    # the hand-written loop: this rank's micro-batches of net's iterator
    loader = net.get_iterator(Dataset(X, y), training=True)
    loader = DataLoader(
        loader.dataset, collate_fn=loader.collate_fn,
        batch_sampler=list(loader.batch_sampler)[rank::world_size])
    ddp, criterion = DistributedDataParallel(module()), torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def hand_epoch():
        batches = iter(loader)
        while step := list(itertools.islice(batches, ACC_STEPS)):
            for index, (Xi, yi) in enumerate(step):
                last = index == len(step) - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    (criterion(ddp(Xi), yi) / len(step)).backward()
            optimizer.step()
            optimizer.zero_grad()

    times = harness.interleave({
        'gradacc': lambda: net.partial_fit(X, y), 'hand': hand_epoch}, rounds)
    diff = max((a - b).abs().max().item() for a, b in zip(
        net.module_.module.parameters(), ddp.module.parameters()))
    return {'times': times, 'max_param_diff': diff}


def main(argv=None):
    parser = harness.parser('benchmarks.ddp_overlap', __doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=7)
    args = parser.parse_args(argv)
    run = harness.torchrun(time_epochs, args.rounds, malloc='default')[0]
    ratios = {kind: harness.summary(
        [a / b for a, b in zip(run['times'][kind]['gradacc'],
                               run['times'][kind]['hand'])])
        for kind in ('wall', 'cpu')}
    result = {'rows': N_ROWS, 'batch_size': BATCH_SIZE, 'acc_steps': ACC_STEPS,
              'parameters': sum(p.numel() for p in module().parameters()),
              'ratio': ratios, **run,
              'meta': harness.provenance('benchmarks.ddp_overlap', sys.argv[1:])}
    print('GradAcc / hand-written DDP loop, per epoch: wall {:.3f}x '
          '({:.3f}x to {:.3f}x), CPU {:.3f}x; max param diff {:.1e}; load '
          'average {:.1f}'.format(
              ratios['wall']['median'], ratios['wall']['min'],
              ratios['wall']['max'], ratios['cpu']['median'],
              run['max_param_diff'], os.getloadavg()[0]))
    harness.save(args.out, 'ddp_overlap', result)


if __name__ == '__main__':
    main()
