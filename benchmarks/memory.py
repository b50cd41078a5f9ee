"""Peak memory of training: activations, and the process's peak RSS.

Two measurements, of plain skorch at ``B`` and at ``B * k``, of
``GradAccNeuralNetClassifier(B, k)`` and (peak RSS only) of skorch's FAQ
recipe at ``(B, k)``:

* **Activation memory** (:func:`activation_peak`): the peak bytes of the
  tensors autograd saves for backward, counted by the package's
  :func:`skorch_gradacc.activation_memory.track_activation_memory`. It is
  exact and deterministic, and it is what accumulation saves.
* **Peak RSS** (:func:`rss_peaks`): each configuration trains in a fresh
  process, forked from a server process that has imported torch and skorch
  but run nothing, so every child starts from the same state. The child
  builds its data and its net, pays torch's one-time costs on a copy of the
  module, reads its resident set size (the baseline), trains one epoch, and
  reads its peak RSS with ``resource.getrusage``. The difference is the
  memory that training took: activations, gradients, optimizer state, the
  batches themselves and, with glibc's default settings, heap
  fragmentation. Each configuration is measured with glibc's defaults and
  with a fixed mmap threshold, which takes fragmentation out. Peak RSS is
  measured on Linux only (``/proc/self/statm``, ``ru_maxrss`` in KiB).
"""

import copy
import ctypes
import gc
import multiprocessing
import os
import resource

import torch

from benchmarks.contenders import make_net
from benchmarks.models import make_data, make_module
from benchmarks.timing import summary
from skorch_gradacc.activation_memory import track_activation_memory

__all__ = ['activation_peak', 'rss_peaks']


def _fit(kind, model, module_kwargs, batch_size, acc_steps, n_rows, seed=0):
    X, y = make_data(model, n_rows, **module_kwargs)
    module, module_kwargs = make_module(model, **module_kwargs)
    net = make_net(kind, module, module_kwargs, batch_size, acc_steps)
    torch.manual_seed(seed)
    net.initialize()
    return net, X, y


def activation_peak(kind, model, module_kwargs, batch_size, acc_steps, n_rows):
    """Peak bytes saved for backward while training one epoch of ``n_rows``.

    ``kind`` is ``'plain'`` (at ``batch_size``) or ``'gradacc'``.
    """
    net, X, y = _fit(kind, model, module_kwargs, batch_size, acc_steps, n_rows)
    with track_activation_memory() as meter:
        net.partial_fit(X, y)
    return meter.peak_bytes


def _resident_kib():
    with open('/proc/self/statm') as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf('SC_PAGE_SIZE') // 1024


def _fix_mmap_threshold(threshold):
    """Make glibc's malloc ``mmap`` every block of ``threshold`` bytes or more.

    Such blocks are returned to the system on ``free``.
    By default glibc raises this threshold as blocks are freed, so that
    large tensors end up in the heap, where freed memory stays resident and
    fragments; peak RSS then depends on the order of allocations as much as
    on the memory in use. A fixed threshold makes peak RSS track the memory
    in use. Returns whether it could be set (glibc only).
    """
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (AttributeError, OSError):
        return False


_M_MMAP_THRESHOLD = -3  # from glibc's malloc.h


def _rss_child(job, conn):
    """Train one configuration in this fresh process; send back its memory."""
    fixed = job['malloc'] == 'fixed' and _fix_mmap_threshold(64 * 1024)
    torch.set_num_threads(job['threads'])
    net, X, y = _fit(job['kind'], job['model'], job['module_kwargs'],
                     job['batch_size'], job['acc_steps'], job['n_rows'])
    # pay torch's one-time costs (kernels, autograd engine) on a copy of the
    # module, so that the baseline holds them for every configuration alike
    warm = copy.deepcopy(net.module_)
    warm(torch.as_tensor(X[:2])).sum().backward()
    del warm
    gc.collect()
    baseline = _resident_kib()
    # the meter only wraps what autograd saves anyway: it adds no tensors
    with track_activation_memory() as meter:
        net.partial_fit(X, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    conn.send({'baseline_kib': baseline, 'peak_kib': peak,
               'train_kib': max(peak - baseline, 0),
               'activation_bytes': meter.peak_bytes,
               'fixed_mmap_threshold': fixed})
    conn.close()


def rss_context():
    """A ``forkserver`` context whose server has imported torch and skorch.

    The server starts, and imports, in the background on the first call;
    call this early to have it ready when it is needed.
    """
    context = multiprocessing.get_context('forkserver')
    # torch._dynamo: the first optimizer imports it, which takes seconds
    context.set_forkserver_preload(
        ['torch', 'torch._dynamo', 'skorch', 'sklearn', 'numpy', 'skorch_gradacc',
         'benchmarks.contenders', 'benchmarks.models', 'benchmarks.memory'])
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return context


def rss_peaks(jobs, repeats, threads=1, timeout=600):
    """Measure every job ``repeats`` times, each in a fresh child process.

    The jobs are interleaved: repeat 1 of every job, then repeat 2, and so
    on. Each job is a dict with ``kind``, ``model``, ``module_kwargs``,
    ``batch_size``, ``acc_steps``, ``n_rows`` and ``malloc``: ``'default'``
    for glibc's defaults, ``'fixed'`` for a fixed mmap threshold (see
    :func:`_fix_mmap_threshold`).

    Returns
    -------
    results : list of dict
      For each job, summaries of ``train_kib`` (peak RSS minus the baseline
      just before training), ``peak_kib``, ``baseline_kib`` and
      ``activation_bytes`` (the activation peak of the same run).

    """
    context = rss_context()
    raw = [[] for _ in jobs]
    for _ in range(repeats):
        for index, job in enumerate(jobs):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_rss_child, args=(dict(job, threads=threads), sender))
            process.start()
            sender.close()
            try:
                if not receiver.poll(timeout):
                    raise RuntimeError('timed out')
                raw[index].append(receiver.recv())
            except (EOFError, RuntimeError) as exc:
                process.kill()
                process.join()
                raise RuntimeError('RSS child failed (exit code {}, {}): {}'.format(
                    process.exitcode, exc or 'no result', job)) from None
            process.join()
    return [
        {key: summary([run[key] for run in runs])
         for key in ('train_kib', 'peak_kib', 'baseline_kib', 'activation_bytes')}
        for runs in raw
    ]
