"""Does ``micro_batch_size='auto'`` keep its ``memory_budget``?

    python -m benchmarks.memory_plan --out benchmark_results  # --quick: smoke, 1 thread

Six workloads, three budgets, three repeats, each fit in a fresh process with users'
environment (no ``MALLOC_*``, ``GLIBC_TUNABLES``, ``OMP_NUM_THREADS``) after a small
warm-up fit (torch's optimizer machinery, ~64 MiB). Peaks from outside the package,
which resets ``VmHWM``: a memory cgroup (v1) per process, its peak reset before
``fit`` after ``malloc_trim``, less the usage then (no cgroups: ``RssAnon`` each ms);
``'auto'`` under a cgroup limit of that usage plus the budget. Fixed sizes, bisected
(to 10%) for the largest whose repeats all stay within the budget, run uncapped after
``tensors_off_the_heap`` as ``'auto'`` does; at the middle budget, ``RLIMIT_AS``. And
``'auto'`` again with ``GLIBC_THRESHOLD`` (glibc's default threshold, 128 KiB, fixed).
"""

import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from resource import RLIM_INFINITY, RLIMIT_AS, setrlimit

import numpy as np
import torch
from skorch import NeuralNet, NeuralNetClassifier, NeuralNetRegressor

import skorch_gradacc
from benchmarks import harness
from benchmarks.stream_memory import VOCAB, TokenCrossEntropy, TokenHead
from benchmarks.workloads import cnn, mlp
from skorch_gradacc.meters import tensors_off_the_heap

MiB = 2 ** 20
#: name: (B, batches, budgets in MiB): tight ~2x one row's need, >= 32; large ~ B's peak
WORKLOADS = {'mlp': (2048, 2, (32, 40, 48)), 'cnn': (256, 2, (32, 64, 128)),
             'token_lm': (64, 2, (32, 64, 128)), 'gru': (128, 2, (32, 64, 96)),
             'classes': (1024, 2, (64, 96, 144)), 'regressor': (8192, 2, (32, 48, 72))}
QUICK = {'mlp': (512, 2, (32,))}  # the machinery, on one workload
EPOCHS, REPEATS, TOLERANCE = 2, {False: 3, True: 1}, {False: 1.1, True: 2.0}
CE = {'criterion': torch.nn.CrossEntropyLoss}  # on logits (skorch's default: NLL)
SGD = dict(CE, optimizer=torch.optim.SGD, optimizer__momentum=0.9, lr=0.01)
GLIBC_THRESHOLD = {'MALLOC_MMAP_THRESHOLD_': '131072'}  # glibc's default, not moving


class GRUClassifier(torch.nn.GRU):
    """A GRU over token ids (0: padding), classed by its state at each one's end."""

    def __init__(self):
        super().__init__(32, 256, batch_first=True)
        self.embed, self.out = torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(256, 10)

    def forward(self, X):
        states = super().forward(self.embed(X))[0]
        return self.out(states[torch.arange(len(X)), (X != 0).sum(1) - 1])


def longest_first(dataset, batch_size, **kwargs):
    """Batches of similar lengths, each cut to its longest sequence (0: padding),
    the longest first (as transformers' ``group_by_length``), the others shuffled."""
    order = np.argsort((dataset.X != 0).sum(1), kind='stable')[::-1].tolist()
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def collate(items):
        X, y = torch.utils.data.default_collate(items)
        return X[:, :(length := int((X != 0).sum(1).max()))], y[:, :length]
    return torch.utils.data.DataLoader(dataset, collate_fn=collate, batch_sampler=(
        batches[:1] + [batches[1 + i] for i in torch.randperm(len(batches) - 1)]))


def make(name, plain, batch_size, rows, **params):
    """``(net, X, y)``: a workload's seeded net, plain or GradAcc, and its data."""
    torch.manual_seed(0)
    module, kwargs = {
        'mlp': lambda: (mlp(64, 1024, 10), SGD), 'cnn': lambda: (cnn(3, 32), SGD),
        'classes': lambda: (mlp(64, 256, 8192, n_layers=1), SGD),
        'regressor': lambda: (mlp(64, 512, 1), {'optimizer': torch.optim.Adagrad}),
        'token_lm': lambda: (TokenHead(), {
            'optimizer': torch.optim.AdamW, 'lr': 1e-3, 'criterion': TokenCrossEntropy,
            'iterator_train': longest_first}),
        'gru': lambda: (GRUClassifier(), dict(CE, optimizer=torch.optim.Adam, lr=1e-3)),
    }[name]()
    rng = np.random.default_rng(0)
    padding = np.arange(64) >= rng.integers(8, 65, rows)[:, None]  # 8 to 64 tokens
    X = rng.standard_normal((rows, 3, 32, 32) if name == 'cnn' else (rows, 64),
                            dtype=np.float32)
    y = rng.integers(0, 8192 if name == 'classes' else 10, rows)
    if name in ('token_lm', 'gru'):
        X = np.where(padding, 0, rng.integers(1, VOCAB, (rows, 64)))
    if name == 'token_lm':  # the next token, -100 at the end
        y = np.where(np.roll(padding, -1, 1), -100, np.roll(X, -1, 1))
    elif name == 'regressor':
        y = X @ rng.standard_normal((64, 1), dtype=np.float32)
    cls = {'token_lm': NeuralNet, 'regressor': NeuralNetRegressor}.get(
        name, NeuralNetClassifier)
    return (cls if plain else getattr(skorch_gradacc, 'GradAcc' + cls.__name__))(
        module, batch_size=batch_size, max_epochs=EPOCHS, train_split=None, verbose=0,
        **kwargs, **params), X, y


def child(name, kind, batch_size, batches, budget, params, cgroup):
    """One fit in this fresh process (see above), and what it measured."""
    (warm := make(name, False, 4, 8, micro_batch_size=2))[0].fit(*warm[1:])  # warm-up
    net, X, y, warm = *make(name, False, batch_size, batch_size * batches, **params), 0
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # the heap's free memory is not the fit's
    if kind == 'rlimit_as':
        setrlimit(RLIMIT_AS, (harness._status_kib('VmSize') * 1024 + budget * MiB,
                              RLIM_INFINITY))
    samples, done = [harness._status_kib('RssAnon') * 1024], threading.Event()
    if cgroup:
        usage = int(Path(cgroup, 'memory.usage_in_bytes').read_text())
        Path(cgroup, 'memory.max_usage_in_bytes').write_text('0')
        if kind == 'auto':  # the container's limit
            Path(cgroup, 'memory.limit_in_bytes').write_text(str(usage + budget * MiB))
    else:  # a thread samples RssAnon each millisecond
        threading.Thread(daemon=True, target=lambda: samples.extend(harness._status_kib(
            'RssAnon') * 1024 for _ in iter(lambda: done.wait(0.001), True))).start()
    error, clock = None, time.perf_counter()
    try:
        with tensors_off_the_heap():  # as 'auto' does at its fit's start, for all
            net.fit(X, y)
    except (RuntimeError, MemoryError, ValueError) as exc:
        error = '{}: {}'.format(type(exc).__name__, exc).splitlines()[0][:200]
    seconds = time.perf_counter() - clock
    done.set()
    setrlimit(RLIMIT_AS, (RLIM_INFINITY,) * 2)
    peak = int(Path(cgroup, 'memory.max_usage_in_bytes').read_text()) - usage if (
        cgroup) else max(samples) - samples[0]
    plan, rows = net.memory_plan_, sum(net.history[:, 'batches'], [])
    backoffs = sum((row.get('micro_batch_size_backoff', []) for row in rows), [])
    result = {'error': error, 'peak': peak, 'plan': plan, 'backoffs': backoffs,
              'malloc': os.environ.get('MALLOC_MMAP_THRESHOLD_'), 'step_seconds': None
              if error else (seconds - (plan or {}).get('plan_seconds', 0)) / len(rows)}
    if kind == 'rlimit_as' and not error:  # against plain skorch, uncapped, on a
        plain = ThreadPoolExecutor(1).submit(lambda: make(  # new thread: oneDNN PR 5907
            name, True, batch_size, 1)[0].fit(X, y).module_.state_dict()).result()
        result['max_param_diff'] = max(float((value - plain[key]).abs().max()) for
                                       key, value in net.module_.state_dict().items())
    return result


def spawn(env=(), **args):
    """:func:`child` in a fresh process, in a memory cgroup of its own if made, with
    users' environment and ``env``."""
    try:  # inside this process's
        cgroup = Path('/sys/fs/cgroup/memory' + re.findall(
            ':memory:(.*)', Path('/proc/self/cgroup').read_text())[0],
            'skorch-gradacc-bench-' + uuid.uuid4().hex)
        cgroup.mkdir()
    except (OSError, IndexError):
        cgroup = None
    env = dict({key: value for key, value in os.environ.items() if not key.startswith(
        ('MALLOC_', 'GLIBC_TUNABLES', 'OMP_NUM_THREADS'))}, **dict(env))
    command = [sys.executable, '-m', 'benchmarks.memory_plan', '--child',
               json.dumps(dict(args, cgroup=cgroup and str(cgroup)))]
    proc = subprocess.Popen(  # the shell joins the cgroup, then runs python
        ['sh', '-c', 'echo $$ > "$0" && exec "$@"', str(cgroup) + '/cgroup.procs']
        + command if cgroup else command, cwd=harness.ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        if cgroup:
            cgroup.rmdir()
    return dict(json.loads(out.splitlines()[-1]) if not proc.returncode else dict(
        peak=None, plan=None, backoffs=[], step_seconds=None, error='exit code {}: {}'
        .format(proc.returncode, err.strip()[-200:])), killed=proc.returncode == -9,
        method='cgroup' if cgroup else 'sampler')  # SIGKILL: the kernel's


def largest_fitting(fits, start, high, tolerance=1.1):
    """The largest ``n <= high`` with ``fits(n)``, doubling from ``start``, then
    bisecting to ``tolerance``; and the least that failed (None: none failed)."""
    low, fail, n = 0, high + 1, max(1, min(start, high))
    while fail - low > 1 and fail > tolerance * low:
        low, fail = (n, fail) if fits(n) else (low, n)
        n = (min(2 * low, high) if fail > high else int((low * fail) ** 0.5)
             if low else fail // 2)
        n = min(max(n, low + 1), fail - 1)
    return low, None if fail > high else fail


def measure(name, budget, quick):
    """A budget's (MiB) ``'auto'`` fits, the largest fixed size within it."""
    batch_size, batches, budgets = (QUICK if quick else WORKLOADS)[name]
    probes, auto = {}, {'micro_batch_size': 'auto', 'memory_budget': budget * MiB}
    run = dict(name=name, batch_size=batch_size, batches=batches, budget=budget,
               env={'OMP_NUM_THREADS': '1'} if quick else {})  # quick: beside tests
    fits = [spawn(kind='auto', params=auto, **run) for _ in range(REPEATS[quick])]
    plans = [(fit, fit['plan']) for fit in fits if fit['plan']]

    def within(n, repeats=REPEATS[quick]):  # all within, as 'auto'; the highest peak
        probe = spawn(kind='fixed', params={'micro_batch_size': n}, **run)
        probes[n] = None if probe['error'] else max(probe['peak'], probes.get(n, 0))
        return probes[n] is not None and probes[n] <= budget * MiB and (
            repeats <= 1 or within(n, repeats - 1))
    chosen = [(fit['plan'] or {}).get('micro_batch_size') for fit in fits]
    largest, over = largest_fitting(within, min(filter(None, chosen), default=1),
                                    batch_size, TOLERANCE[quick])
    return {'fits': fits, 'chosen': chosen, 'largest': largest, 'smallest_over': over,
            'probes': dict(sorted(probes.items())),
            'rlimit_as': spawn(kind='rlimit_as', params=auto, **run) if budget == (
                budgets[len(budgets) // 2]) else None,
            'glibc_threshold': [spawn(kind='auto', params=auto, **dict(run, env=dict(
                run['env'], **GLIBC_THRESHOLD))) for _ in range(REPEATS[quick])],
            'measured_vs_budget': [fit['peak'] / budget / MiB for fit in fits
                                   if fit['peak'] is not None],
            'predicted_vs_measured': [plan['predicted_peak'] / fit['peak']
                                      for fit, plan in plans if fit['peak']],
            'chosen_vs_largest': [plan['micro_batch_size'] / largest
                                  for _, plan in plans if largest],
            'pieces': [-(-batch_size // (n or batch_size)) for n in [largest] + chosen],
            'plan_steps': [plan['plan_seconds'] / fit['step_seconds']
                           for fit, plan in plans if fit['step_seconds']]}


def _span(values, fmt='{:.2f}'):
    low, high = (min(values), max(values)) if values else (float('nan'),) * 2
    return fmt.format(low) if low == high else (fmt + ' to ' + fmt).format(low, high)


def tables(results):
    """The CSV table (rows, the header first) of the saved results."""
    return {'memory_plan': [[
        'workload', 'B', 'budget (MiB)', 'chosen', 'max measured / budget',
        'predicted / measured', 'largest fixed within budget', 'chosen / largest',
        'pieces per batch: largest fixed; chosen', 'planning (steps)', 'back-offs',
        'killed', 'under RLIMIT_AS', 'with MALLOC_MMAP_THRESHOLD_=131072: chosen; max '
        'measured / budget; step time / default']] + [[
        name, entry['batch_size'], budget, '/'.join(map(str, row['chosen'])),
        _span(row['measured_vs_budget'] and [max(row['measured_vs_budget'])]),
        _span(row['predicted_vs_measured']), row['largest'],
        _span(row['chosen_vs_largest']), '{}; {}'.format(row['pieces'][0], '/'.join(
            map(str, row['pieces'][1:]))), _span(row['plan_steps']),
        sum(len(fit['backoffs']) for fit in row['fits']),
        sum(fit['killed'] for fit in row['fits']), (cap := row['rlimit_as']) and (
            '{}; {} back-offs; {:.1e}'.format(('trained', 'failed')[bool(cap['error'])],
                len(cap['backoffs']), cap.get('max_param_diff', float('nan')))) or '-',
        glibc_threshold(row, int(budget))]
        for name, entry in results['workloads'].items()
        for budget, row in entry['budgets'].items()]}


def glibc_threshold(row, budget):
    """The column of the ``GLIBC_THRESHOLD`` fits of a budget (MiB)."""
    if not (fits := row.get('glibc_threshold')) or any(fit['error'] for fit in fits):
        return 'failed' if fits else '-'
    step = [np.nanmean([f['step_seconds'] or np.nan for f in each])  # of those trained
            for each in (fits, row['fits'])]
    return '{}; {:.2f}; {:.2f}'.format('/'.join(str(f['plan']['micro_batch_size'])
        for f in fits), max(f['peak'] for f in fits) / budget / MiB, step[0] / step[1])


def targets(results):
    """The issue's targets: text, what was measured, whether it was met."""
    rows = [row for entry in results['workloads'].values()
            for row in entry['budgets'].values()]
    fits = [fit for row in rows for fit in row['fits']]
    capped = [row['rlimit_as'] for row in rows if row['rlimit_as']]
    every = {key: [x for row in rows for x in row[key]] for key in (
        'measured_vs_budget', 'chosen_vs_largest', 'plan_steps')}
    failed, killed = (sum(bool(fit[k]) for fit in fits) for k in ('error', 'killed'))
    same = [len(set(row['chosen'])) == 1 for row in rows]
    return [{'target': text, 'measured': measured, 'met': bool(met)} for text,
            measured, met in [
        ("every 'auto' fit trains, none killed by its cgroup's limit", '{} of {} '
         'failed, {} killed'.format(failed, len(fits), killed), not failed),
        ("every 'auto' fit's measured peak <= its budget", 'measured / budget: '
         + _span(every['measured_vs_budget']), not killed and max(
             every['measured_vs_budget'], default=0) <= 1),
        ('the same chosen size in each repeat', '{} of {} budgets'.format(
            sum(same), len(same)), all(same)),
        ('chosen >= 0.6x the largest fixed size within the budget', _span(
            every['chosen_vs_largest']) + 'x', min(every['chosen_vs_largest'],
                                                   default=0) >= 0.6),
        ('planning <= 1.5 optimizer steps', _span(every['plan_steps']) + ' steps',
         max(every['plan_steps'], default=9) <= 1.5),
        ('under RLIMIT_AS, every workload trains', '{} of {}, {} back-offs, within '
         '{:.1e} of plain skorch'.format(
             sum(not fit['error'] for fit in capped), len(capped),
             sum(len(fit['backoffs']) for fit in capped),
             max(fit.get('max_param_diff', 0) for fit in capped)),
         not any(fit['error'] for fit in capped))]]


def markdown(results):
    """The Markdown of the saved results."""
    rows = tables(results)['memory_plan']
    return '\n'.join([
        '# Memory plans against measurements', '', '`{command}`, commit `{git_commit}`'
        ', {cpu_count} CPUs (load average {load_average[0]:.1f}), {0:.0f} s, peaks by '
        '{method}.'.format(results['seconds'], **results['meta']), '',
        harness.markdown_table(['target', 'measured', 'met'], [
            [row['target'], row['measured'], 'yes' if row['met'] else '**no**']
            for row in results['targets']]),
        harness.markdown_table(rows[0], rows[1:])])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ['--child']:
        print(json.dumps(child(**json.loads(argv[1]))), flush=True)
        return 0
    parser = harness.parser('benchmarks.memory_plan', __doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='a smoke run')
    args = parser.parse_args(argv)
    workloads, start = QUICK if args.quick else WORKLOADS, time.perf_counter()
    results = {'meta': harness.provenance('benchmarks.memory_plan', argv),
               'quick': args.quick, 'repeats': REPEATS[args.quick]}
    with ThreadPoolExecutor(1) as pool:  # one fit at a time, as users run one: timed
        fits = {(name, budget): pool.submit(measure, name, budget, args.quick)
                for name, (_, _, budgets) in workloads.items() for budget in budgets}
        results['workloads'] = {name: {'batch_size': B, 'batches': n, 'budgets': {
            str(budget): fits[name, budget].result() for budget in budgets}}
            for name, (B, n, budgets) in workloads.items()}
    results['meta']['method'] = fits[next(iter(fits))].result()['fits'][0]['method']
    results.update(seconds=time.perf_counter() - start, targets=targets(results))
    harness.save(args.out, 'memory_plan', results, markdown(results), **tables(results))
    return 0


if __name__ == '__main__':
    sys.exit(main())
