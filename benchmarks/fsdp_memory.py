"""Per-rank memory of FSDP2 against DDP, where the model's state dominates.

    python -m benchmarks.fsdp_memory --out benchmark_results

On 2 gloo ranks (``harness.torchrun``): ``ddp`` (``DistributedGradAccMixin``),
``fsdp`` (``FullyShardedGradAccMixin``) and ``fsdp_each``
(``sync_each_batch=True``), on an MLP of 16 ``Linear(1024, 1024)`` layers trained
with Adam, ``acc_steps=4``. Each rank reports in MiB over the RSS before
initialization: the peak while the net initializes (every rank builds the whole
module before sharding it), the RSS after it, the peak of one epoch (the figure to
compare) and the RSS after it. Writes ``fsdp_memory.json`` and ``.csv``.
"""

import sys

import torch

import skorch_gradacc
from benchmarks import harness
from benchmarks.workloads import mlp

CONFIGS = ('ddp', 'fsdp', 'fsdp_each')
WIDTH, DEPTH, ROWS, BATCH_SIZE, ACC_STEPS = 1024, 16, 256, 8, 4
COLUMNS = ('init_peak', 'after_init', 'train_peak', 'after_train')


def rank(config):
    """One rank's figures (MiB) of a configuration, under ``harness.torchrun``."""
    torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()  # one-time costs
    torch.distributed.all_reduce(torch.ones(1))
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(ROWS, WIDTH, generator=generator)
    y = torch.randint(0, 10, (ROWS,), generator=generator)
    mixin = (skorch_gradacc.DistributedGradAccMixin if config == 'ddp'
             else skorch_gradacc.FullyShardedGradAccMixin)
    torch.manual_seed(0)
    net = type('Net', (mixin, skorch_gradacc.GradAccNeuralNetClassifier), {})(
        mlp, module__n_in=WIDTH, module__n_hidden=WIDTH, module__n_layers=DEPTH,
        criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.Adam, lr=1e-4,
        batch_size=BATCH_SIZE, acc_steps=ACC_STEPS, max_epochs=1, train_split=None,
        verbose=0, **({'sync_each_batch': True} if config == 'fsdp_each' else {}))
    init_peak, after_init, _ = harness.peak_growth_kib(net.initialize)
    train_peak, after_train, _ = harness.peak_growth_kib(lambda: net.partial_fit(X, y))
    # over the RSS before initialization
    figures = [init_peak, after_init, after_init + train_peak, after_init + after_train]
    return {column: kib / 1024 for column, kib in zip(COLUMNS, figures)}


def tables(results):
    """The CSV table (rows, the header first) of the saved results."""
    return {'fsdp_memory': [
        ['configuration', 'rank', 'init peak (MiB)', 'after init (MiB)',
         'train peak (MiB)', 'after training (MiB)']] + [
        [config, rank] + [round(row[column]) for column in COLUMNS]
        for config in CONFIGS for rank, row in enumerate(results[config])]}


def parse_args(argv=None):
    return harness.parser('benchmarks.fsdp_memory',
                          __doc__.splitlines()[0]).parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = {'meta': harness.provenance('benchmarks.fsdp_memory', argv)}
    results.update({config: harness.torchrun(rank, config) for config in CONFIGS})
    harness.save(args.out, 'fsdp_memory', results, **tables(results))
    return 0


if __name__ == '__main__':
    sys.exit(main())
