"""Peak memory of ``fit`` where the outputs or the inputs are large.

    python -m benchmarks.stream_memory --sweep --out benchmark_results

Peak RSS growth of one epoch in a fresh process (``benchmarks.harness``) of plain
skorch at the micro-batch ``B``, ``GradAccNeuralNet(B, k)`` and plain skorch at
``B * k``, on: ``lm_tokens``, a language model's head (Embedding -> Linear to
2,000 words over 64 tokens: the logits are the largest tensor), token-level
cross-entropy; ``lm_last``, its last position's logits only, a view that keeps
them all alive; ``mlp_4096`` and ``mlp_10``, MLPs with 4,096 and 10 classes;
``images``, 3x128x128 inputs pooled at once; ``lm_train_acc``, ``lm_tokens`` with
``EpochScoring(token_accuracy, on_train=True)``, whose cached logits the GradAcc
net must hold as plain skorch does, and no more. ``--sweep`` adds ``lm_tokens``
for ``acc_steps`` 1 to 32. Writes ``stream_memory.json`` and the CSV tables
(``stream_memory.csv``, ``stream_memory_sweep.csv``) that the docs show.
"""

import statistics
import sys

import torch
from skorch import NeuralNet
from skorch.callbacks import EpochScoring

from benchmarks import harness
from benchmarks.workloads import mlp
from skorch_gradacc import GradAccNeuralNet

#: name: (B, k, rows)
MODELS = {'lm_tokens': (8, 32, 512), 'lm_last': (8, 32, 512),
          'mlp_4096': (256, 16, 8192), 'mlp_10': (256, 16, 8192),
          'images': (8, 32, 512), 'lm_train_acc': (8, 32, 512)}
VOCAB, TOKENS = 2000, 64
SWEEP = (1, 2, 4, 8, 16, 32)


class TokenHead(torch.nn.Module):
    def __init__(self, last_only=False):
        super().__init__()
        self.embed, self.last_only = torch.nn.Embedding(VOCAB, 64), last_only
        self.head = torch.nn.Linear(64, VOCAB)

    def forward(self, X):
        logits = self.head(torch.tanh(self.embed(X)))
        return logits[:, -1] if self.last_only else logits


class TokenCrossEntropy(torch.nn.CrossEntropyLoss):
    def forward(self, logits, y):
        return super().forward(logits.reshape(-1, VOCAB), y.reshape(-1))


def token_accuracy(net, X, y):
    """The share of tokens whose most likely word is the target."""
    logits = net.forward(X)  # the cached outputs, with caching
    return float((logits.argmax(-1) == torch.as_tensor(y)).double().mean())


def build(name, rows):
    """Return ``(module, criterion, X, y)`` for a model, float32."""
    generator = torch.Generator().manual_seed(0)
    if name.startswith('lm_'):
        X = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
        if name == 'lm_last':
            y = torch.randint(0, VOCAB, (rows,), generator=generator)
            return TokenHead(True), torch.nn.CrossEntropyLoss, X, y
        y = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
        return TokenHead(), TokenCrossEntropy, X, y
    classes = {'mlp_4096': 4096, 'mlp_10': 10, 'images': 10}[name]
    y = torch.randint(0, classes, (rows,), generator=generator)
    if name == 'images':
        X = torch.randn(rows, 3, 128, 128, generator=generator)
        return torch.nn.Sequential(
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(3, 10)), torch.nn.CrossEntropyLoss, X, y
    X = torch.randn(rows, 64, generator=generator)
    return mlp(64, 512, classes, n_layers=1), torch.nn.CrossEntropyLoss, X, y


def make_net(name, kind, batch_size, acc_steps, rows, **kwargs):
    """Return ``(net, X, y)``: plain skorch (``kind='plain'``) or
    ``GradAccNeuralNet`` (``'gradacc'``) on a model, initialized."""
    module, criterion, X, y = build(name, rows)
    kwargs.update(criterion=criterion, max_epochs=1, train_split=None, verbose=0,
                  lr=0.01, optimizer=torch.optim.SGD, batch_size=batch_size,
                  callbacks=[EpochScoring(token_accuracy, on_train=True,
                                          name='train_acc')]
                  if name == 'lm_train_acc' else [])
    if kind == 'gradacc':
        kwargs['acc_steps'] = acc_steps
    return (GradAccNeuralNet if kind == 'gradacc' else NeuralNet)(
        module, **kwargs).initialize(), X, y


def _train_kib(*args):
    return harness.train_peak_kib(*make_net(*args))


def measure(name, kind, batch_size, acc_steps=1, rows=None):
    """The peak-RSS growth of one epoch of ``fit`` in KiB, in a fresh process;
    ``kind`` is ``'plain'`` or ``'gradacc'``."""
    return harness.fresh_process(_train_kib, name, kind, batch_size, acc_steps,
                                 rows or MODELS[name][2])


def _three(name, B, k, rows):
    """Plain at B, GradAcc at (B, k) and plain at B * k, in MiB."""
    return {'plain_B': measure(name, 'plain', B, 1, rows) / 1024,
            'gradacc': measure(name, 'gradacc', B, k, rows) / 1024,
            'plain_Bk': measure(name, 'plain', B * k, 1, rows) / 1024}


def measure_models(names, repeats=3):
    """Each model as :func:`_three`, repeats interleaved; medians in MiB."""
    runs = [{name: _three(name, *MODELS[name]) for name in names}
            for _ in range(repeats)]
    results = {}
    for name in names:
        row = {kind: statistics.median(run[name][kind] for run in runs)
               for kind in runs[0][name]}
        B, k, _ = MODELS[name]
        results[name] = dict(row, B=B, k=k, ratio=row['gradacc'] / row['plain_B'])
    return results


def tables(results):
    """The CSV tables (rows, the header first) of the saved results."""
    out = {'stream_memory': [
        ['model', 'B', 'k', 'plain at B (MiB)', 'GradAcc (MiB)', 'ratio',
         'plain at B·k (MiB)']] + [
        [name, row['B'], row['k'], round(row['plain_B']), round(row['gradacc']),
         '{:.2f}x'.format(row['ratio']), round(row['plain_Bk'])]
        for name, row in results['models'].items()]}
    if results['sweep']:
        out['stream_memory_sweep'] = [
            ['acc_steps', 'plain at B=8 (MiB)', 'GradAcc at (8; k) (MiB)',
             'plain at 8·k (MiB)']] + [
            [row['k'], round(row['plain_B']), round(row['gradacc']),
             round(row['plain_Bk'])] for row in results['sweep']]
    return out


def parse_args(argv=None):
    parser = harness.parser('benchmarks.stream_memory', __doc__.split('\n\n')[0])
    parser.add_argument('--sweep', action='store_true',
                        help='also measure lm_tokens for acc_steps 1..32')
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = {'meta': harness.provenance('benchmarks.stream_memory', argv),
               'repeats': 3, 'models': measure_models(list(MODELS)),
               'sweep': [dict(_three('lm_tokens', 8, k, 512), k=k) for k in SWEEP]
               if args.sweep else []}
    harness.save(args.out, 'stream_memory', results, **tables(results))
    return 0


if __name__ == '__main__':
    sys.exit(main())
