"""Benchmark GradAccNeuralNetClassifier against plain skorch, skorch's FAQ recipe,
AccelerateMixin and a hand-written loop: overhead, memory, exactness and scaling.

    python -m benchmarks.run --out benchmark_results

``--quick``: tiny sizes, a smoke run of well under a minute; ``--sections``: only
the sections named. Writes ``benchmarks.json`` (every number, every round, the
run's provenance), ``benchmarks.md`` (the tables) and ``benchmarks.png``.
"""

import copy
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import harness, report, suite

SECTIONS = ('overhead', 'memory', 'exactness', 'scaling', 'profile')

#: Sizes of the full run: the keyword arguments of each section's function in
#: :mod:`benchmarks.suite`. ``models`` are the timing workloads: ``n`` rows,
#: micro-batch ``B``, ``k`` micro-batches per step.
MODELS = {'mlp': {'n': 2048, 'B': 32, 'k': 8}, 'cnn': {'n': 512, 'B': 16, 'k': 8},
          'transformer': {'n': 384, 'B': 16, 'k': 8}}
KS = [1, 2, 4, 8, 16, 32, 64]
FULL = {
    'overhead': {'models': MODELS, 'rounds': 25, 'warmup': 1},
    'memory': {
        'models': MODELS, 'ks': KS, 'repeats': 3, 'rss_repeats': 3,
        'rss_malloc': ['fixed', 'default'],
        # sized so that activations, not parameters, dominate
        'rss_models': {
            'mlp': {'B': 256, 'ks': [8], 'module_kwargs': {'n_hidden': 512}},
            'cnn': {'B': 16, 'ks': [4, 16, 64],
                    'module_kwargs': {'in_channels': 3, 'image_size': 16}},
            'transformer': {'B': 16, 'ks': [8], 'module_kwargs': {'seq_len': 64}}}},
    # sizes that leave a short last micro-batch and a partial last group
    'exactness': {'epochs': 3, 'models': {
        'mlp': {'n': 1003, 'B': 16, 'k': 4}, 'cnn': {'n': 1003, 'B': 16, 'k': 4},
        'transformer': {'n': 251, 'B': 8, 'k': 4}}},
    # 64 micro-batches per epoch: one group at k=64
    'scaling': {'ks': KS, 'rounds': 5, 'k_models': {
        'mlp': {'n': 2048, 'B': 32}, 'cnn': {'n': 1024, 'B': 16},
        'transformer': {'n': 512, 'B': 8}},
        'data': {'model': 'mlp', 'B': 32, 'k': 8, 'ns': [512, 1024, 2048, 4096, 8192]}},
    'profile': {'name': 'mlp', 'cfg': MODELS['mlp'], 'top': 15},
}

#: Tiny sizes for a smoke run: every code path, no meaningful numbers.
TINY = {'mlp': {'n_hidden': 32}, 'cnn': {},
        'transformer': {'seq_len': 8, 'd_model': 16, 'n_layers': 1}}


def _tiny(mlp, cnn, transformer):
    return {name: {'n': n, 'B': B, 'k': 4, 'module_kwargs': TINY[name]}
            for name, (n, B) in zip(TINY, (mlp, cnn, transformer))}


TINY_MODELS = _tiny((64, 8), (32, 4), (32, 4))
QUICK = {
    'overhead': {'models': TINY_MODELS, 'rounds': 2, 'warmup': 0},
    'memory': {'models': TINY_MODELS, 'ks': [1, 2, 4], 'repeats': 1, 'rss_repeats': 1,
               'rss_malloc': ['fixed'], 'rss_models': {
                   'mlp': {'B': 16, 'ks': [4], 'module_kwargs': TINY['mlp']}}},
    'exactness': {'epochs': 2, 'models': _tiny((43, 4), (43, 4), (27, 2))},
    'scaling': {'ks': [1, 2, 4], 'rounds': 1,
                'k_models': {'mlp': {'n': 32, 'B': 8, 'module_kwargs': TINY['mlp']}},
                'data': {'model': 'mlp', 'B': 8, 'k': 2, 'ns': [16, 32, 64],
                         'module_kwargs': TINY['mlp']}},
    'profile': {'name': 'mlp', 'cfg': TINY_MODELS['mlp'], 'top': 5},
}


def parse_args(argv=None):
    parser = harness.parser('benchmarks.run', __doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true',
                        help='tiny sizes: a smoke run, no real numbers')
    parser.add_argument('--sections', nargs='+', choices=SECTIONS, default=SECTIONS,
                        help='run only these (default: all)')
    return parser.parse_args(argv)


def main(argv=None):
    """Run the benchmarks; write the results; return an exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    config = copy.deepcopy(QUICK if args.quick else FULL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the steadiest on a shared machine
    meta = harness.provenance('benchmarks.run', argv)
    meta.update(torch_threads=1, load_average_start=meta.pop('load_average'))
    results = {'meta': meta, 'quick': args.quick, 'config': config, 'seconds': {}}
    try:
        for name in args.sections:
            print('running {} ...'.format(name), file=sys.stderr, flush=True)
            start = time.perf_counter()
            results[name] = getattr(suite, name)(**config[name])
            results['seconds'][name] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)  # leave the process as it was
    meta['load_average_end'] = os.getloadavg()
    results['targets'] = report.evaluate_targets(results)
    harness.save(args.out, 'benchmarks', results, report.markdown(results))
    report.plot(results, Path(args.out) / 'benchmarks.png')
    return 0


if __name__ == '__main__':
    sys.exit(main())
