"""Peak memory of ``fit`` where outputs or inputs are large
(``python -m benchmarks.stream_memory``): accumulation holds one
micro-batch, so its peak stays near plain skorch's at the micro-batch.

Each figure comes from a fresh process (see the benchmark's docstring);
memory, not time, is asserted. On a GPU, ``torch.cuda.max_memory_allocated``
measures the same for the language model's head.
"""

import functools
import sys
from pathlib import Path

import pytest
import torch

from conftest import background, background_result

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.stream_memory import MODELS, make_net, measure  # noqa: E402

CAN_MEASURE = Path('/proc/self/clear_refs').exists()
LINUX = pytest.mark.skipif(not CAN_MEASURE,
                           reason='measures peak RSS through /proc (Linux)')


def median_of_3(name, kind, B, k, rows):
    """The median of three fresh processes: one sample can be an outlier."""
    return sorted(measure(name, kind, B, k, rows) for _ in range(3))[1]


def peaks(name):
    """Plain skorch at B and GradAcc at (B, k), medians of three, and plain
    skorch at B * k (but for lm_train_acc), in KiB; in the background from
    the collection's end (conftest.py)."""
    B, k, rows = MODELS[name]
    return (median_of_3(name, 'plain', B, 1, rows),
            median_of_3(name, 'gradacc', B, k, rows),
            None if name == 'lm_train_acc' else
            measure(name, 'plain', B * k, 1, rows))


NAMES = ['lm_tokens', 'lm_last', 'mlp_4096', 'images', 'lm_train_acc']
TASKS = {name: functools.partial(peaks, name) for name in NAMES}


@LINUX
@pytest.mark.parametrize('name', [
    pytest.param(name, marks=background(TASKS[name]) if CAN_MEASURE else ())
    for name in NAMES])
def test_gradacc_peak_within_1_25x_of_plain_at_the_micro_batch(name):
    plain, gradacc, large = background_result(TASKS[name])
    # the allocator's granularity: a few MiB either way are noise
    assert gradacc <= 1.25 * plain + 2048, (plain, gradacc)
    if name == 'lm_train_acc':
        # the epoch's cached logits, which the large batch holds as well,
        # dominate: only the comparison with plain skorch at B applies
        return
    assert gradacc < 0.5 * large, (gradacc, large)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_gradacc_gpu_memory_is_that_of_the_micro_batch():
    B, k, rows = MODELS['lm_tokens']
    peaks = {}
    for kind, batch_size in (('plain', B), ('gradacc', B), ('plain', B * k)):
        torch.manual_seed(0)
        net, X, y = make_net('lm_tokens', kind, batch_size, k, rows,
                             device='cuda')
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        net.partial_fit(X, y)
        torch.cuda.synchronize()
        peaks[kind, batch_size] = torch.cuda.max_memory_allocated() - before
        del net
    print({key: value / 2 ** 20 for key, value in peaks.items()})  # MiB
    # the allocator's granularity: a few MiB either way are noise
    assert peaks['gradacc', B] <= 1.25 * peaks['plain', B] + 2 ** 21, peaks
    assert peaks['gradacc', B] < 0.5 * peaks['plain', B * k], peaks
