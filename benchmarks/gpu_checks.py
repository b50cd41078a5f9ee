"""Run every CUDA check of the project on one GPU, and print one table.

Usage, from the repository root, on a machine with a GPU::

    PYTHONPATH=$PWD python benchmarks/gpu_checks.py

It has not yet run on a GPU, so how long it takes is not known. The
checks: the tests marked ``cuda`` or named for CUDA; ``fp16`` and
``bf16`` against full precision (relative loss difference);
``micro_batch_size='auto'`` after a real CUDA out-of-memory error (1 GiB
cap), float64, within ``1e-10`` of plain skorch; a language model head's
``torch.cuda.max_memory_allocated`` as plain skorch at ``B``,
``GradAccNeuralNet(B, k)`` and plain skorch at ``B * k``; ``torchrun`` with
NCCL and one rank against the single process, within ``1e-10``; and one
step with tensor item counts under ``torch.cuda.set_sync_debug_mode('error')``.
With ``--dry-run`` (or without a GPU) the same code runs on the CPU, small,
where it can; the rest reports ``not run``. ``tests/test_distributed.py``
runs the dry run, so that the script does not rot. The exit status is 1 if
a check failed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / 'tests'
sys.path[:0] = [str(ROOT), str(TESTS)]

from skorch import NeuralNetClassifier  # noqa: E402

from skorch_gradacc import (  # noqa: E402
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
)
from skorch_gradacc.demo import max_param_diff  # noqa: E402
from skorch_gradacc.grouping import MicroBatchGroups  # noqa: E402

__all__ = ['CHECKS', 'main']

NOT_RUN = 'not run'


class NotRun(Exception):
    """A check that cannot run here (no GPU); its message says why."""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get('PYTHONPATH', '')]), OMP_NUM_THREADS='1')


def check_cuda_tests(device, dry):
    """The tests marked ``cuda`` or named for CUDA, with pytest."""
    files = sorted(str(path) for path in TESTS.glob('test_*.py')
                   if re.search(r'mark\.cuda|cuda\.is_available',
                                path.read_text()))
    args = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
            '-k', 'cuda', *files]
    if dry:
        args.append('--collect-only')
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=_env())
    summary = (proc.stdout.strip().splitlines() or [''])[-1]
    if dry:
        if proc.returncode != 0:
            raise AssertionError(summary)
        raise NotRun('needs a GPU; ' + summary)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert 'skipped' not in summary, summary
    return summary


def _mlp_data(n=512):
    from conftest import classification_data
    X, y = classification_data(n)
    return X.astype(np.float32), y


def _fit_classifier(device, **kwargs):
    from test_mixed_precision import Float32MLP
    X, y = _mlp_data(512 if device == 'cuda' else 128)
    torch.manual_seed(0)
    return GradAccNeuralNetClassifier(
        Float32MLP, batch_size=8, acc_steps=4, max_epochs=3, lr=0.1,
        train_split=None, verbose=0, device=device, **kwargs).fit(X, y)


def check_mixed_precision(device, dry, precision):
    """``mixed_precision`` against full precision: relative loss change."""
    if precision == 'bf16' and device == 'cuda' and not (
            torch.cuda.is_bf16_supported()):
        raise NotRun('this GPU has no bf16')
    amp = _fit_classifier(device, mixed_precision=precision)
    full = _fit_classifier(device)
    amp_loss = np.array(amp.history[:, 'train_loss'])
    full_loss = np.array(full.history[:, 'train_loss'])
    diff = float(np.max(np.abs(amp_loss - full_loss) / full_loss))
    assert np.all(np.isfinite(amp_loss)) and diff < 5e-2, diff
    return 'train_loss within {:.1e} of float32 on {}'.format(diff, device)


def check_auto_oom(device, dry):
    """``micro_batch_size='auto'`` after a real CUDA out-of-memory error."""
    X, y = _mlp_data(4000 if not dry else 64)
    kwargs = dict(batch_size=len(X), max_epochs=1, train_split=None,
                  verbose=0, device=device, lr=0.1)
    class Wide64(torch.nn.Module):
        def __init__(self, n_hidden):
            super().__init__()
            self.hidden = torch.nn.Linear(10, n_hidden, dtype=torch.float64)
            self.output = torch.nn.Linear(n_hidden, 3, dtype=torch.float64)

        def forward(self, X):
            return torch.softmax(self.output(torch.relu(self.hidden(
                X.double()))), dim=-1)

    wide = dict(module=Wide64, module__n_hidden=16384 if not dry else 64)
    if not dry:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(2 ** 30 / total)
    try:
        torch.manual_seed(0)
        net = GradAccNeuralNetClassifier(micro_batch_size='auto', **wide,
                                         **kwargs).fit(X, y)
    finally:
        if not dry:
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(**wide, **kwargs).fit(X, y)
    diff = max_param_diff(net, plain)
    assert diff <= 1e-10, diff
    if dry:
        raise NotRun('needs a GPU for a real out-of-memory error; ran '
                     'without one, parameters within {:.1e}'.format(diff))
    found = net.micro_batch_size_
    assert found is not None and found < len(X), found
    return 'backed off to {} of {} rows; parameters within {:.1e}'.format(
        found, len(X), diff)


def check_lm_memory(device, dry):
    """Peak GPU memory of a language model's head: plain at ``B``, GradAcc
    ``(B, k)``, plain at ``B * k``."""
    from benchmarks.stream_memory import MODELS, make_net
    B, k, rows = MODELS['lm_tokens']
    peaks = {}
    for name, kind, size in (('plain B', 'plain', B), ('GradAcc', 'gradacc', B),
                             ('plain B*k', 'plain', B * k)):
        torch.manual_seed(0)
        net, X, y = make_net('lm_tokens', kind, size, k,
                             rows if not dry else B * 4, device=device)
        if not dry:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        net.partial_fit(X, y)
        if not dry:
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        del net
    if dry:
        raise NotRun('needs a GPU for torch.cuda.max_memory_allocated')
    assert peaks['GradAcc'] < peaks['plain B*k'] / 2, peaks
    return ', '.join('{} {:.0f} MiB'.format(k, v) for k, v in peaks.items())


def check_nccl(device, dry):
    """torchrun with NCCL and one rank against the single process."""
    from test_distributed import (
        ACC_STEPS,
        BATCH_SIZE,
        assert_same_as_single_process,
        classifier,
    )
    backend = 'gloo' if dry else 'nccl'
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [sys.executable, '-m', 'torch.distributed.run', '--standalone',
             '--nproc_per_node', '1',
             str(TESTS / 'torchrun_scripts' / 'ddp_worker.py'), out, 'samples',
             backend], capture_output=True, text=True, timeout=300,
            env=_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        ranks = [torch.load(Path(out) / 'rank0.pt')]
    assert_same_as_single_process(
        ranks, classifier(195, batch_size=BATCH_SIZE * ACC_STEPS))
    if dry:
        raise NotRun('needs a GPU; gloo with one rank matched')
    return 'parameters and train_loss within 1e-10'


def check_sync_free_step(device, dry):
    """One GradAcc step with tensor item counts under
    ``torch.cuda.set_sync_debug_mode('error')`` (issue 21): the step must
    not wait for the GPU."""
    from test_normalization import IGNORE, TokenTagger, token_data

    class TensorCountNet(GradAccNeuralNet):
        def count_loss_items(self, batch):
            _, y = batch
            return (y.to(self.device) != IGNORE).sum()

    X, y = token_data(64)
    net = TensorCountNet(TokenTagger, criterion=torch.nn.CrossEntropyLoss,
                         criterion__ignore_index=IGNORE, acc_steps=4, lr=0.1,
                         device=device, verbose=0,
                         train_split=None).initialize()
    # micro-batches already on the device: copying from the host would wait
    X, y = torch.as_tensor(X, device=device), torch.as_tensor(y, device=device)
    micro_batches = [(X[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    group = next(iter(MicroBatchGroups(micro_batches, 4)))
    net._zero_grad_optimizer()
    if dry:
        net.accumulate_gradients(group)
        raise NotRun('needs a GPU for set_sync_debug_mode')
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        net.accumulate_gradients(group)
    finally:
        torch.cuda.set_sync_debug_mode('default')
    return 'no host sync in the step'


CHECKS = [
    ('cuda tests', check_cuda_tests),
    ('fp16', lambda device, dry: check_mixed_precision(device, dry, 'fp16')),
    ('bf16', lambda device, dry: check_mixed_precision(device, dry, 'bf16')),
    ('auto OOM', check_auto_oom),
    ('LM memory', check_lm_memory),
    ('NCCL, world size 1', check_nccl),
    ('sync-free step', check_sync_free_step),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dry-run', action='store_true',
                        help='run on the CPU, small; GPU checks: not run')
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = 'cpu' if dry else 'cuda'
    rows = []
    for name, check in CHECKS:
        start = time.perf_counter()
        try:
            status, detail = 'pass', check(device, dry)
        except NotRun as reason:
            status, detail = NOT_RUN, str(reason)
        except Exception as exc:  # noqa: BLE001 (the table reports it)
            status = 'FAIL'
            detail = '{}: {}'.format(type(exc).__name__, exc)
        rows.append((name, status, time.perf_counter() - start,
                     ' '.join(detail.split())[:160]))
    print('device: {}'.format(torch.cuda.get_device_name(0) if not dry
                              else 'CPU (dry run)'))
    print('| check | status | seconds | detail |')
    print('|---|---|---|---|')
    for name, status, seconds, detail in rows:
        print('| {} | {} | {:.0f} | {} |'.format(name, status, seconds,
                                                 detail))
    return int(any(status == 'FAIL' for _, status, _, _ in rows))


if __name__ == '__main__':
    sys.exit(main())
