"""How every benchmark measures: time, peak RSS, and where a run came from.

* **Time** (:func:`interleave`): the contenders take turns in an order rotated
  from round to round, and ratios are taken within a round, so that a slow phase
  of a shared machine slows both sides of a ratio.
* **Peak RSS** (:func:`fresh_process`, :func:`torchrun`): each measurement in a
  fresh process. With ``malloc='fixed'``, glibc ``mmap`` s every block of 64 KiB
  or more and returns it on ``free`` (``MALLOC_MMAP_THRESHOLD_=65536``), so that
  peak RSS follows the memory in use; ``'default'`` keeps glibc's settings, where
  freed memory stays in the heap. torch's one-time costs are paid first, then the
  kernel's peak counter is reset (``/proc/self/clear_refs``) and the growth of the
  peak (``VmHWM``) over the RSS just before is what the work took. Linux only.
* **Provenance** (:func:`provenance`): command, commit, machine and versions.
"""

import argparse
import copy
import csv
import ctypes
import gc
import importlib.util
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

import skorch_gradacc

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.perf_counter()  # a benchmark's process imports this first


def summary(values):
    """Median, min and max of a list of numbers (and the numbers)."""
    values = [float(value) for value in values]
    return {'median': statistics.median(values), 'min': min(values),
            'max': max(values), 'n': len(values), 'values': values}


def markdown_table(header, rows):
    """A Markdown table of ``rows`` (lists of cells), then an empty line."""
    return '\n'.join(['| ' + ' | '.join(header) + ' |',
                      '|' + '|'.join('---' for _ in header) + '|']
                     + ['| ' + ' | '.join(map(str, row)) + ' |' for row in rows]
                     + [''])


def interleave(contenders, rounds, warmup=1):
    """Time each callable of ``contenders`` (name: callable) once per round,
    after ``warmup`` untimed rounds: ``{'cpu': {name: seconds per round}, 'wall':
    ...}``. CPU time is the process's own, which other processes disturb less."""
    names = list(contenders)
    times = {clock: {name: [] for name in names} for clock in ('cpu', 'wall')}
    # collect before each timed run; what exists now is frozen: cheap to collect
    gc.collect()
    gc.freeze()
    try:
        for _ in range(warmup):
            for name in names:
                contenders[name]()
        for round_ in range(rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in reversed(order) if round_ % 2 else order:
                gc.collect()
                wall, cpu = time.perf_counter(), time.process_time()
                contenders[name]()
                times['cpu'][name].append(time.process_time() - cpu)
                times['wall'][name].append(time.perf_counter() - wall)
    finally:
        gc.unfreeze()
    return times


def _status_kib(field):
    with open('/proc/self/status') as status:
        return next(int(line.split()[1]) for line in status
                    if line.startswith(field + ':'))


def peak_growth_kib(work):
    """Run ``work()``: the growth (KiB) of the peak RSS and of the RSS, and what
    ``work`` returned."""
    gc.collect()
    Path('/proc/self/clear_refs').write_text('5')  # the peak starts again from the RSS
    baseline = _status_kib('VmRSS')
    result = work()
    return _status_kib('VmHWM') - baseline, _status_kib('VmRSS') - baseline, result


def train_peak_kib(net, X, y):
    """Peak RSS growth (KiB) of one ``net.partial_fit(X, y)``, after torch's
    one-time costs (kernels, autograd) are paid on a copy of the module."""
    copy.deepcopy(net.module_)(torch.as_tensor(X[:2])).sum().backward()
    return peak_growth_kib(lambda: net.partial_fit(X, y))[0]


def prepare_process(malloc='fixed'):
    """One torch thread; with ``'fixed'``, glibc ``mmap`` s 64 KiB blocks."""
    if malloc == 'fixed' and not ctypes.CDLL(None).mallopt(-3, 65536):
        raise RuntimeError('mallopt(M_MMAP_THRESHOLD) failed: not glibc?')
    torch.set_num_threads(1)


def _child(function, args, malloc, conn):
    prepare_process(malloc)
    conn.send(function(*args))
    conn.close()


def fresh_process(function, *args, malloc='fixed', timeout=600):
    """``function(*args)`` (module-level) called in a fresh process."""
    context = multiprocessing.get_context('forkserver')
    # torch._dynamo: the first optimizer imports it, which takes seconds
    context.set_forkserver_preload(['torch', 'torch._dynamo', 'skorch', 'sklearn',
                                    'skorch_gradacc', 'benchmarks.workloads'])
    receiver, sender = context.Pipe(duplex=False)
    (process := context.Process(target=_child, args=(function, args, malloc,
                                                     sender))).start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            raise RuntimeError('timed out')
        return receiver.recv()
    except (EOFError, RuntimeError) as exc:
        process.kill()
        raise RuntimeError('measurement failed (exit code {}, {}): {}{}'.format(
            process.exitcode, exc or 'no result', function.__name__, args)) from None
    finally:
        process.join()


def torchrun(function, *args, nproc=2, malloc='fixed', timeout=600):
    """Each rank's ``function(*args)`` (a list), on ``nproc`` gloo ranks started
    by ``torchrun``; ``function`` is module-level, its arguments and result JSON."""
    module = function.__module__
    if module == '__main__':  # run as ``python -m module``
        module = sys.modules['__main__'].__spec__.name
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    proc = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nproc_per_node', str(nproc), '-m', 'benchmarks.harness', module,
         function.__name__, malloc, json.dumps(args)],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError('{}{} failed: {}'.format(
            function.__name__, args, proc.stderr[-3000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rank(module, name, malloc, args):
    """One rank of :func:`torchrun`; rank 0 prints every rank's result."""
    prepare_process(malloc)
    dist.init_process_group('gloo')
    result = getattr(importlib.import_module(module), name)(*json.loads(args))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        print(json.dumps(every), flush=True)
    dist.barrier()  # no rank tears down while another still talks
    dist.destroy_process_group()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)


def _git(*args):
    try:
        return subprocess.run(['git', *args], capture_output=True, text=True,
                              check=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance(module, argv):
    """Where and from what a run came: command, commit, machine, versions."""
    package = Path(skorch_gradacc.__file__).parent
    changes = _git('status', '--porcelain', '--', str(package))
    cpuinfo = Path('/proc/cpuinfo')
    cpu = next((line.split(':', 1)[1].strip() for line in (
        cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
        if line.startswith('model name')), platform.processor() or 'unknown')
    names = ('torch', 'skorch', 'accelerate', 'numpy', 'sklearn', 'skorch_gradacc')
    versions = {name: importlib.import_module(name).__version__
                if importlib.util.find_spec(name) else None for name in names}
    return {
        'date': datetime.now(timezone.utc).isoformat(timespec='seconds'),
        'command': ' '.join(['python -m', module] + list(argv)),
        'git_commit': _git('rev-parse', '--short', 'HEAD'),
        'skorch_gradacc': {'path': str(package),
                           'modified': None if changes is None else bool(changes)},
        'cpu': cpu, 'cpu_count': os.cpu_count(), 'platform': platform.platform(),
        'python': platform.python_version(), 'versions': versions,
        'load_average': os.getloadavg()}


def parser(module, description):
    """The command line of ``python -m module``, with the ``--out`` folder."""
    parser = argparse.ArgumentParser(prog='python -m ' + module,
                                     description=description)
    parser.add_argument('--out', default='benchmark_results', metavar='DIR',
                        help='folder for the results (committed: benchmarks/results)')
    return parser


def save(out, name, results, markdown=None, **tables):
    """Write ``name.json`` (``results``), ``name.md`` (``markdown``) and each
    table (rows, header first) as ``KEY.csv`` into ``out``; print the paths."""
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    results['meta']['wall_seconds'] = round(time.perf_counter() - STARTED)  # to quote
    paths = [out / (name + '.json')]
    paths[0].write_text(json.dumps(results, indent=1) + '\n')
    if markdown is not None:
        paths.append(out / (name + '.md'))
        paths[-1].write_text(markdown)
    for key, rows in tables.items():
        paths.append(out / (key + '.csv'))
        with open(paths[-1], 'w', newline='') as file:
            csv.writer(file, lineterminator='\n').writerows(rows)
    print(*paths, sep='\n')
    return paths


if __name__ == '__main__':
    _rank(*sys.argv[1:])
