"""Per-rank memory of FSDP2 against DDP, where the model's state dominates.

Usage, from the repository root::

    python -m benchmarks.fsdp_memory --out benchmarks/results

Each configuration runs under ``torchrun --nproc_per_node 2`` with gloo on
the CPU, in fresh processes with ``MALLOC_MMAP_THRESHOLD_=65536``, so that
RSS follows the memory in use. Linux only. The model is an MLP of 16
``Linear(1024, 1024)`` layers (16.8 M parameters, 64 MiB in float32)
trained with Adam on micro-batches of 8 rows, ``acc_steps=4``, so that
parameters, gradients and optimizer state dominate; a single process
would hold 64 MiB of parameters, 64 of gradients and 128 of Adam's state.

Each rank warms up torch (autograd, a gloo all-reduce), builds its data,
and takes the RSS as its baseline. Then, with the kernel's peak counter
reset (``/proc/self/clear_refs``) before each phase, it reports, in MiB
over the baseline:

* ``init_peak``: the peak while the net initializes (the whole module is
  built on every rank before it is sharded or wrapped);
* ``after_init``: the RSS after initialization;
* ``train_peak``: the peak during one epoch of training (the figure to
  compare);
* ``after_train``: the RSS after it (parameters, gradients and optimizer
  state as training leaves them).

The configurations: ``ddp`` (:class:`~skorch_gradacc.DistributedGradAccMixin`),
``fsdp`` (:class:`~skorch_gradacc.FullyShardedGradAccMixin`, one
reduce-scatter per step) and ``fsdp_each`` (``sync_each_batch=True``).
Writes ``fsdp_memory.json`` and ``fsdp_memory.md``.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ['CONFIGS', 'measure', 'main']

CONFIGS = ('ddp', 'fsdp', 'fsdp_each')
WIDTH, DEPTH, ROWS, BATCH_SIZE, ACC_STEPS = 1024, 16, 256, 8, 4
ROOT = Path(__file__).resolve().parent.parent


def _status_mib(field):
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1]) / 1024
    raise RuntimeError('{} not in /proc/self/status'.format(field))


def _reset_peak():
    with open('/proc/self/clear_refs', 'w') as clear_refs:
        clear_refs.write('5')  # the peak RSS starts again from the RSS


def _mlp():
    import torch

    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _rank(config, out):
    """One rank of a configuration; rank 0 writes every rank's figures."""
    import gc

    import torch
    import torch.distributed as dist

    from skorch_gradacc import (
        DistributedGradAccMixin,
        FullyShardedGradAccMixin,
        GradAccNeuralNetClassifier,
    )

    dist.init_process_group('gloo')
    torch.set_num_threads(1)
    warm = torch.nn.Linear(4, 4)
    warm(torch.randn(2, 4)).sum().backward()
    dist.all_reduce(torch.ones(1))
    del warm
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(ROWS, WIDTH, generator=generator)
    y = torch.randint(0, 10, (ROWS,), generator=generator)

    mixin = DistributedGradAccMixin if config == 'ddp' else FullyShardedGradAccMixin
    net_cls = type('Net', (mixin, GradAccNeuralNetClassifier), {})
    kwargs = {'sync_each_batch': True} if config == 'fsdp_each' else {}
    torch.manual_seed(0)
    net = net_cls(_mlp, criterion=torch.nn.CrossEntropyLoss,
                  optimizer=torch.optim.Adam, lr=1e-4, batch_size=BATCH_SIZE,
                  acc_steps=ACC_STEPS, max_epochs=1, train_split=None,
                  verbose=0, **kwargs)
    gc.collect()
    baseline = _status_mib('VmRSS')
    _reset_peak()
    net.initialize()
    figures = {'init_peak': _status_mib('VmHWM') - baseline,
               'after_init': _status_mib('VmRSS') - baseline}
    _reset_peak()
    net.partial_fit(X, y)
    figures.update(train_peak=_status_mib('VmHWM') - baseline,
                   after_train=_status_mib('VmRSS') - baseline)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every))
    dist.barrier()  # no rank tears down while another still talks
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)


def measure(config, out_dir):
    """Run ``config`` under torchrun; return each rank's figures (MiB)."""
    out = Path(out_dir) / 'fsdp_memory_{}.tmp.json'.format(config)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536', OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join(
                   [str(ROOT)] + [p for p in [os.environ.get('PYTHONPATH')]
                                  if p]))
    proc = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nproc_per_node', '2', str(Path(__file__).resolve()), '--rank',
         config, str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError('{} failed: {}'.format(config, proc.stderr[-3000:]))
    figures = json.loads(out.read_text())
    out.unlink()
    return figures


def markdown(results):
    lines = ['| configuration | rank | init peak | after init | train peak '
             '| after training |', '|---|---|---|---|---|---|']
    for config, ranks in results.items():
        for rank, row in enumerate(ranks):
            lines.append('| {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |'
                         .format(config, rank, row['init_peak'],
                                 row['after_init'], row['train_peak'],
                                 row['after_train']))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', type=Path, default=ROOT / 'benchmarks' / 'results')
    parser.add_argument('--rank', nargs=2, metavar=('CONFIG', 'OUT'),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        _rank(*args.rank)
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    results = {config: measure(config, args.out) for config in CONFIGS}
    (args.out / 'fsdp_memory.json').write_text(json.dumps(results, indent=2))
    (args.out / 'fsdp_memory.md').write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == '__main__':
    main()
