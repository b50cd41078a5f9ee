"""Peak memory of ``fit`` where the outputs or the inputs are large.

Usage, from the repository root::

    python -m benchmarks.stream_memory --out benchmarks/results

Each configuration trains in a fresh Python process started with glibc
told to return freed blocks at once (``MALLOC_MMAP_THRESHOLD_=65536``), so
that peak RSS follows the memory in use. The child builds its data and its
net, pays torch's one-time costs on a copy of the module, resets the
kernel's peak-RSS counter (``/proc/self/clear_refs``), trains, and reports
the growth of the peak (``VmHWM``) over the RSS just before ``fit``: what
training took. Linux only.

The models, each compared as plain skorch at the micro-batch ``B``,
``GradAccNeuralNet(B, k)`` and plain skorch at ``B * k``:

* ``lm_tokens``: a language model's head, Embedding -> Linear to a
  2,000-word vocabulary over 64 tokens; the logits (B, 64, 2000) are the
  largest tensor; token-level cross-entropy.
* ``lm_last``: the same head, returning only the last position's logits,
  a view that keeps the whole logits tensor alive if it is kept.
* ``mlp_4096``: an MLP with a 4,096-class head.
* ``mlp_10``: an MLP with a 10-class head (small outputs).
* ``images``: 3x128x128 images that the model pools at once, so that the
  inputs dominate.
* ``lm_train_acc``: ``lm_tokens`` with skorch's standard way to log the
  training accuracy, ``EpochScoring(token_accuracy, on_train=True)`` with
  its defaults (caching). Plain skorch caches every batch's logits and
  targets for the epoch's score; the GradAcc net must cache the same, and
  no more (never the inputs, no activations).

``--sweep`` also measures ``lm_tokens`` for ``acc_steps`` from 1 to 32 at a
fixed micro-batch. Writes ``stream_memory.json``, ``stream_memory.md`` and
the tables as CSV (``stream_memory.csv``, ``stream_memory_sweep.csv``),
which the docs include.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ['MODELS', 'measure', 'main']

#: name: (B, k, rows)
MODELS = {
    'lm_tokens': (8, 32, 512),
    'lm_last': (8, 32, 512),
    'mlp_4096': (256, 16, 8192),
    'mlp_10': (256, 16, 8192),
    'images': (8, 32, 512),
    'lm_train_acc': (8, 32, 512),
}

VOCAB, TOKENS = 2000, 64


def _build(name, rows):
    """Return ``(module, criterion, X, y)`` for a model, float32."""
    import torch

    generator = torch.Generator().manual_seed(0)

    class TokenHead(torch.nn.Module):
        def __init__(self, last_only):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 64)
            self.head = torch.nn.Linear(64, VOCAB)
            self.last_only = last_only

        def forward(self, X):
            logits = self.head(torch.tanh(self.embed(X)))
            return logits[:, -1] if self.last_only else logits

    class TokenCrossEntropy(torch.nn.CrossEntropyLoss):
        def forward(self, logits, y):
            return super().forward(logits.reshape(-1, VOCAB), y.reshape(-1))

    if name in ('lm_tokens', 'lm_last', 'lm_train_acc'):
        X = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
        if name != 'lm_last':
            y = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
            return TokenHead(False), TokenCrossEntropy, X, y
        y = torch.randint(0, VOCAB, (rows,), generator=generator)
        return TokenHead(True), torch.nn.CrossEntropyLoss, X, y
    if name in ('mlp_4096', 'mlp_10'):
        classes = 4096 if name == 'mlp_4096' else 10
        X = torch.randn(rows, 64, generator=generator)
        y = torch.randint(0, classes, (rows,), generator=generator)
        module = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, classes))
        return module, torch.nn.CrossEntropyLoss, X, y
    if name == 'images':
        X = torch.randn(rows, 3, 128, 128, generator=generator)
        y = torch.randint(0, 10, (rows,), generator=generator)
        module = torch.nn.Sequential(
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(3, 10))
        return module, torch.nn.CrossEntropyLoss, X, y
    raise ValueError('unknown model {!r}'.format(name))


def token_accuracy(net, X, y):
    """The share of tokens whose most likely word is the target."""
    import torch

    logits = net.forward(X)  # the cached outputs, with caching
    return float((logits.argmax(-1) == torch.as_tensor(y)).double().mean())


def _callbacks(name):
    """Return the callbacks a model trains with."""
    if name != 'lm_train_acc':
        return []
    from skorch.callbacks import EpochScoring

    return [EpochScoring(token_accuracy, on_train=True, name='train_acc')]


def _status_kib(field):
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError('{} not in /proc/self/status'.format(field))


def _child(name, kind, batch_size, acc_steps, rows):
    """Train one configuration in this process; print its memory as JSON."""
    import copy
    import gc

    import torch
    from skorch import NeuralNet

    from skorch_gradacc import GradAccNeuralNet

    torch.set_num_threads(1)
    module, criterion, X, y = _build(name, rows)
    kwargs = dict(criterion=criterion, max_epochs=1, train_split=None,
                  verbose=0, lr=0.01, optimizer=torch.optim.SGD,
                  callbacks=_callbacks(name))
    if kind == 'gradacc':
        net = GradAccNeuralNet(module, batch_size=batch_size,
                               acc_steps=acc_steps, **kwargs)
    else:
        net = NeuralNet(module, batch_size=batch_size, **kwargs)
    net.initialize()
    # pay torch's one-time costs on a copy of the module, alike for all
    warm = copy.deepcopy(net.module_)
    warm(X[:2]).sum().backward()
    del warm
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as clear_refs:
        clear_refs.write('5')  # reset the peak RSS to the current RSS
    baseline = _status_kib('VmRSS')
    net.partial_fit(X, y)
    peak = _status_kib('VmHWM')
    print(json.dumps({'train_kib': peak - baseline}))


def measure(name, kind, batch_size, acc_steps=1, rows=None):
    """Return the peak-RSS growth of ``fit`` in KiB, from a fresh process."""
    rows = rows or MODELS[name][2]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536',
               OMP_NUM_THREADS='1')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.stream_memory', '--child', name,
         kind, str(batch_size), str(acc_steps), str(rows)],
        capture_output=True, text=True, env=env, timeout=600,
        cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode:
        raise RuntimeError('child failed for {}: {}'.format(
            (name, kind, batch_size, acc_steps), proc.stderr[-2000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])['train_kib']


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def measure_models(names, repeats=1):
    """Measure each model as plain at B, GradAcc (B, k) and plain at B * k.

    Repeats are interleaved; each figure is the median in MiB.
    """
    runs = {name: {'plain_B': [], 'gradacc': [], 'plain_Bk': []}
            for name in names}
    for _ in range(repeats):
        for name in names:
            B, k, rows = MODELS[name]
            runs[name]['plain_B'].append(measure(name, 'plain', B, 1, rows))
            runs[name]['gradacc'].append(measure(name, 'gradacc', B, k, rows))
            runs[name]['plain_Bk'].append(measure(name, 'plain', B * k, 1, rows))
    results = {}
    for name, kinds in runs.items():
        B, k, _ = MODELS[name]
        row = {kind: _median(values) / 1024 for kind, values in kinds.items()}
        row.update(B=B, k=k, ratio=row['gradacc'] / row['plain_B'])
        results[name] = row
    return results


def measure_sweep(ks=(1, 2, 4, 8, 16, 32), batch_size=8, rows=512):
    """``lm_tokens`` at a fixed micro-batch, for each ``acc_steps``."""
    return [{'k': k,
             'plain_B': measure('lm_tokens', 'plain', batch_size, 1, rows) / 1024,
             'gradacc': measure('lm_tokens', 'gradacc', batch_size, k, rows)
             / 1024,
             'plain_Bk': measure('lm_tokens', 'plain', batch_size * k, 1, rows)
             / 1024}
            for k in ks]


def markdown(results, sweep):
    lines = ['| model | B | k | plain at B (MiB) | GradAcc (MiB) | ratio | '
             'plain at B·k (MiB) |', '|---|---|---|---|---|---|---|']
    for name, row in results.items():
        lines.append('| {} | {} | {} | {:.0f} | {:.0f} | {:.2f}x | {:.0f} |'.format(
            name, row['B'], row['k'], row['plain_B'], row['gradacc'],
            row['ratio'], row['plain_Bk']))
    if sweep:
        lines += ['', '| acc_steps | plain at B=8 | GradAcc (8, k) | '
                  'plain at 8·k |', '|---|---|---|---|']
        lines += ['| {k} | {plain_B:.0f} | {gradacc:.0f} | {plain_Bk:.0f} |'
                  .format(**row) for row in sweep]
    return '\n'.join(lines) + '\n'


def csv_tables(results, sweep):
    """Return the CSV text of the models' table and of the sweep's."""
    models = ['model,B,k,plain at B (MiB),GradAcc (MiB),ratio,'
              'plain at B·k (MiB)']
    models += ['{},{},{},{:.0f},{:.0f},{:.2f}x,{:.0f}'.format(
        name, row['B'], row['k'], row['plain_B'], row['gradacc'],
        row['ratio'], row['plain_Bk']) for name, row in results.items()]
    lines = ['acc_steps,plain at B=8 (MiB),GradAcc at (8; k) (MiB),'
             'plain at 8·k (MiB)']
    lines += ['{k},{plain_B:.0f},{gradacc:.0f},{plain_Bk:.0f}'.format(**row)
              for row in sweep]
    return '\n'.join(models) + '\n', '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--child', nargs=5, help=argparse.SUPPRESS)
    parser.add_argument('--out', type=Path, default=None,
                        help='folder for stream_memory.json and .md')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--sweep', action='store_true',
                        help='also measure lm_tokens for acc_steps 1..32')
    args = parser.parse_args(argv)
    if args.child:
        name, kind, B, k, rows = args.child
        _child(name, kind, int(B), int(k), int(rows))
        return 0
    results = measure_models(list(MODELS), repeats=args.repeats)
    sweep = measure_sweep() if args.sweep else []
    text = markdown(results, sweep)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / 'stream_memory.json').write_text(json.dumps(
            {'models': results, 'sweep': sweep}, indent=2))
        (args.out / 'stream_memory.md').write_text(text)
        models_csv, sweep_csv = csv_tables(results, sweep)
        (args.out / 'stream_memory.csv').write_text(models_csv)
        if sweep:
            (args.out / 'stream_memory_sweep.csv').write_text(sweep_csv)
    return 0


if __name__ == '__main__':
    sys.exit(main())
