"""Memory: the budget, the plan of ``micro_batch_size='auto'``, the back-off.

:func:`parse_budget` and :func:`available_memory` give the bytes a fit may
add; :func:`plan_memory` plans the pieces before the first step; after an
allocation failure, :func:`back_off` halves them and replays the group;
:func:`track_activation_memory` counts the bytes saved for backward. The
docs' memory page says what is measured and where a plan can be wrong.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import math
import re
import resource
import time

import numpy as np
import torch

from skorch_gradacc.batching import (
    arrays_in,
    batch_len,
    is_positive_int,
    split_batch,
)
from skorch_gradacc.counting import restore_buffers

__all__ = ['ActivationMemory', 'PeakMemory', 'available_memory', 'batch_cost',
           'is_out_of_memory', 'largest_cost', 'parse_budget',
           'track_activation_memory']


class ActivationMemory:
    """Running and peak bytes of tensors saved for backward.

    Attributes
    ----------
    current_bytes : int
      Bytes saved by graphs that are still alive.

    peak_bytes : int
      The largest value ``current_bytes`` reached.

    """

    def __init__(self):
        self.current_bytes = 0
        self.peak_bytes = 0

    @property
    def peak_mib(self):
        """The peak in MiB."""
        return self.peak_bytes / 2 ** 20

    def _pack(self, tensor):
        return _Saved(self, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor


class _Saved:
    """A saved tensor that reports its bytes until the graph releases it."""

    __slots__ = ('meter', 'tensor', 'nbytes')

    def __init__(self, meter, tensor):
        self.meter = meter
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.current_bytes += self.nbytes
        meter.peak_bytes = max(meter.peak_bytes, meter.current_bytes)

    def __del__(self):
        self.meter.current_bytes -= self.nbytes


@contextlib.contextmanager
def track_activation_memory():
    """Count the bytes of tensors saved for backward inside the block.

    Tensors that several graph nodes save are counted once per node, and
    weights that autograd keeps for backward are counted although they take
    no extra memory. The count therefore overstates activation memory by a
    fixed amount for a given model, whatever the batch size; compare
    measurements with each other, not with the device.

    Examples
    --------
    >>> import torch
    >>> layer = torch.nn.Linear(1000, 10)
    >>> with track_activation_memory() as memory:
    ...     layer(torch.randn(8, 1000)).sum().backward()
    >>> memory.peak_bytes >= 8 * 1000 * 4  # the saved input
    True
    >>> memory.current_bytes  # released by backward
    0

    """
    meter = ActivationMemory()
    with torch.autograd.graph.saved_tensors_hooks(meter._pack, meter._unpack):
        yield meter


# The budget

# the share of the budget that the plan leaves free, for what it does not
# measure: the optimizer step's temporaries, the allocator's fragmentation,
# and the error of the measurement
PLAN_MARGIN = 0.1

# the measured passes at each of the plan's two sizes: more give a steadier
# peak for a longer plan
PLAN_REPEATS = 1

_BUDGET_UNITS = {'b': 1, 'kb': 10 ** 3, 'mb': 10 ** 6, 'gb': 10 ** 9,
                 'tb': 10 ** 12, 'kib': 2 ** 10, 'mib': 2 ** 20,
                 'gib': 2 ** 30, 'tib': 2 ** 40}
_BUDGET = re.compile(r'\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)\s*', re.IGNORECASE)


def parse_budget(value):
    """Return a ``memory_budget`` in bytes, or None.

    ``value`` is None, a positive int (bytes), or a string of a number and
    a unit: ``B``, ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000) or
    ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), in any case.
    Anything else raises a ValueError.

    Examples
    --------
    >>> parse_budget('1.5GiB'), parse_budget('512MB'), parse_budget(4096)
    (1610612736, 512000000, 4096)

    """
    if value is None or is_positive_int(value):
        return value if value is None else int(value)
    match = _BUDGET.fullmatch(value) if isinstance(value, str) else None
    if match is not None:
        nbytes = int(float(match[1]) * _BUDGET_UNITS[match[2].lower()])
        if nbytes >= 1:
            return nbytes
    raise ValueError(
        "memory_budget must be None, a positive number of bytes or a string "
        "such as '2GiB' or '512MB', got {!r} instead.".format(value))


def available_memory(device):
    """Return the bytes this process can still allocate on ``device``.

    * CUDA: the device's free memory (``torch.cuda.mem_get_info``) plus what
      torch's caching allocator holds reserved but unused, and at most what
      ``torch.cuda.set_per_process_memory_fraction`` leaves;
    * CPU: the least of the address space left under ``RLIMIT_AS`` (its soft
      limit minus ``VmSize``), the cgroup's ``memory.max`` (v1:
      ``memory.limit_in_bytes``) minus its usage, and ``MemAvailable`` of
      ``/proc/meminfo``.

    None where none of them can be read (another device, another OS).

    Examples
    --------
    >>> available_memory('cpu') > 0  # on Linux
    True

    """
    device = torch.device(device)
    if device.type == 'cuda':
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, 'get_per_process_memory_fraction', None)
        if fraction is not None:
            available = min(available, int(fraction(device) * total) - allocated)
        return available
    if device.type != 'cpu':
        return None
    limits = [_proc_bytes('/proc/meminfo', 'MemAvailable'), _cgroup_headroom(),
              _address_space_left()]
    limits = [limit for limit in limits if limit is not None]
    return max(0, min(limits)) if limits else None


def _address_space_left():
    """Return the soft ``RLIMIT_AS`` less ``VmSize``, or None without one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _proc_bytes('/proc/self/status', 'VmSize')
    return None if soft == resource.RLIM_INFINITY or size is None else \
        soft - size


def compiled_code_bytes():
    """Return the bytes of code compiled at run time, mapped in this process.

    The anonymous executable mappings of ``/proc/self/maps``: oneDNN
    compiles code for each new shape of a convolution, which a cap on the
    address space (``RLIMIT_AS``) counts, though little of it is resident.
    0 where the file cannot be read.

    Examples
    --------
    >>> compiled_code_bytes() >= 0
    True

    """
    try:
        with open('/proc/self/maps', 'rb') as maps:
            text = maps.read()
    except OSError:
        return 0
    # one bytes object and a match per mapping of code, not an object per
    # line: under a cap, a new arena of Python's small objects counts too
    return sum(int(end, 16) - int(start, 16)
               for start, end in _ANONYMOUS_CODE.findall(text))


# start-end, permissions with x, offset, device, inode, and no file name
_ANONYMOUS_CODE = re.compile(
    rb'^([0-9a-f]+)-([0-9a-f]+) ..x. \S+ \S+ \S+ *$', re.MULTILINE)


def _proc_bytes(path, key):
    """Return the ``key: N kB`` line of a /proc file in bytes, or None."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom():
    """Return the process's cgroup memory limit minus its usage, or None."""
    try:
        with open('/proc/self/cgroup') as lines:
            entries = [line.rstrip('\n').split(':', 2) for line in lines]
    except OSError:
        return None
    candidates = []
    for _, controllers, path in entries:
        if controllers == '':  # v2; in a namespace, the mount is the cgroup
            candidates += [('/sys/fs/cgroup' + path, 'memory.max',
                            'memory.current'),
                           ('/sys/fs/cgroup', 'memory.max', 'memory.current')]
        elif 'memory' in controllers.split(','):  # v1
            candidates += [('/sys/fs/cgroup/memory' + path,
                            'memory.limit_in_bytes', 'memory.usage_in_bytes'),
                           ('/sys/fs/cgroup/memory', 'memory.limit_in_bytes',
                            'memory.usage_in_bytes')]
    for folder, limit, usage in candidates:
        try:
            with open(folder + '/' + limit) as f_limit, \
                    open(folder + '/' + usage) as f_usage:
                limit, usage = f_limit.read().strip(), f_usage.read().strip()
        except OSError:
            continue
        # 'max', or v1's largest page-aligned number: no limit
        if limit == 'max' or int(limit) >= 2 ** 60:
            return None
        return int(limit) - int(usage)
    return None


# The measurement

class PeakMemory:
    """The peak memory allocated on a device above a baseline.

    The baseline is what is allocated when the object is made;
    :meth:`window` measures a block, :meth:`peak` returns its peak above the
    baseline (above the window's start with ``start=True``) and :meth:`held`
    what is allocated now above the baseline; :attr:`windows` counts the
    windows. :attr:`method` says how:
    ``'cuda'`` (``torch.cuda.max_memory_allocated``), ``'rss'`` (the CPU's
    resident high-water mark ``VmHWM``, reset through
    ``/proc/self/clear_refs`` after ``malloc_trim``, less the growth of
    ``RssFile``: code paged in), or, where that cannot be reset,
    ``'saved_tensors'`` (:func:`track_activation_memory`).

    Parameters
    ----------
    device : str or torch.device
      The device whose memory is measured.

    Examples
    --------
    >>> import torch
    >>> meter = PeakMemory('cpu')
    >>> with meter.window():
    ...     x = torch.ones(2 ** 20)
    >>> meter.method in ('rss', 'saved_tensors')
    True

    """

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == 'cuda':
            self.method = 'cuda'
        else:
            self.method = 'rss' if _reset_rss_peak() else 'saved_tensors'
        self._saved, self.windows = None, 0
        self.baseline = self._start = self._current()
        self._file_baseline = self._file_start = self._file_pages()
        self._held_baseline = self._current(held=True)

    def _current(self, held=False):
        if self.method == 'cuda':
            return torch.cuda.memory_allocated(self.device)
        if self.method == 'rss':
            # what stays: anonymous memory, not the pages of code loaded
            return _proc_bytes('/proc/self/status',
                               'RssAnon' if held else 'VmRSS') or 0
        return 0

    def _file_pages(self):
        # VmHWM counts the pages of code and files read in too, which a
        # first pass of a kernel adds once: the peak leaves them out
        if self.method != 'rss':
            return 0
        return _proc_bytes('/proc/self/status', 'RssFile') or 0

    def reset(self):
        """Start a new window: its peak is what is allocated now."""
        if self.method == 'cuda':
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == 'rss':
            _reset_rss_peak()
        self._start = self._current()
        self._file_start = self._file_pages()

    def held(self):
        """Return the bytes held now above the baseline (CPU: anonymous)."""
        return self._current(held=True) - self._held_baseline

    @contextlib.contextmanager
    def window(self):
        """Measure the block: :meth:`peak` is the peak inside it."""
        self.windows += 1
        self.reset()
        if self.method != 'saved_tensors':
            yield self
            return
        with track_activation_memory() as self._saved:
            yield self

    def peak(self, start=False):
        """Return the window's peak bytes above the baseline, or its start."""
        if self.method == 'cuda':
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == 'rss':
            peak = _proc_bytes('/proc/self/status', 'VmHWM')
        else:
            return self._saved.peak_bytes if self._saved is not None else None
        files = self._file_pages() - (self._file_start if start
                                      else self._file_baseline)
        return max(0, peak - files - (self._start if start else self.baseline))


def _reset_rss_peak():
    """Give malloc's free memory back and reset VmHWM; whether it worked."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
    except OSError:
        return False
    return _proc_bytes('/proc/self/status', 'VmHWM') is not None


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
        return libc if hasattr(libc, 'malloc_trim') else None
    except OSError:
        return None


_LIBC = _load_libc()


# The cost of a batch

def batch_cost(batch):
    """Return the cost of a batch: the elements of its largest input.

    The input is ``X`` of a batch ``(X, y, ...)``, or the largest tensor or
    array of a dict, list or tuple ``X``: rows times padded length for
    token batches. None if ``X`` holds none; then the cost is the rows.

    Examples
    --------
    >>> import torch
    >>> batch_cost(({'input_ids': torch.zeros(4, 7), 'mask': None}, None))
    28

    """
    X = batch[0] if isinstance(batch, (tuple, list)) else batch
    sizes = [int(np.prod(x.shape, dtype=np.int64)) for x in arrays_in(X)]
    return max(sizes) if sizes else None


def _cost_per_row(batch):
    rows, cost = batch_len(batch), batch_cost(batch)
    return cost / rows if cost and rows else 1.0


def _nbytes(data):
    """Return the bytes of the tensors and arrays in ``data``.

    Of a DTensor, this rank's shard.
    """
    total = 0
    for array in arrays_in(data):
        if hasattr(array, 'to_local'):  # a DTensor
            array = array.to_local()
        total += array.nbytes if isinstance(array, np.ndarray) else (
            array.nelement() * array.element_size())
    return total


def split_micro_batch(net, micro, group):
    """Return the pieces of ``micro`` that go through the module one by one.

    With a plan, as few pieces as the most rows whose cost is at most its
    ``max_cost`` (at least 1) take, as even as can be
    (:func:`even_piece_rows`); else
    :meth:`~skorch_gradacc.GradAccMixin.get_micro_batch_size` rows. Notes
    ``rows_in_flight``, ``piece_rows`` and ``cost_per_row`` on ``group``
    for a back-off.
    """
    plan = getattr(net, 'memory_plan_', None)
    rows = group.rows_in_flight = batch_len(micro)
    group.cost_per_row = _cost_per_row(micro)
    if plan is None or plan['max_cost'] is None:
        size = net.get_micro_batch_size()
    else:
        size = even_piece_rows(rows, _rows_within(
            plan['max_cost'], group.cost_per_row, rows))
    group.piece_rows = rows if size is None else min(size, rows)
    return [micro] if group.piece_rows >= rows else split_batch(micro, size)


def _rows_within(cost, per_row, rows):
    """Return the most rows, 1 to ``rows``, whose cost is at most ``cost``."""
    return max(1, min(rows, int(cost / per_row + 1e-9)))


def even_piece_rows(rows, size):
    """Return the rows of the first pieces of ``rows`` cut at most ``size``.

    As many pieces as ``size`` takes, as even as can be: the same passes in
    less memory, and fewer shapes, for each of which a convolution may
    compile code (oneDNN).

    Examples
    --------
    >>> even_piece_rows(128, 37)  # 4 pieces of 32, not 37, 37, 37 and 17
    32

    """
    rows = max(rows, 1)  # a rank's empty share: one piece
    return -(-rows // -(-rows // size))


# The plan

def plan_memory(net, group, buffers, **fit_params):
    """Plan the pieces of ``micro_batch_size='auto'`` before the first step.

    Forward and backward passes on the first rows of the group's first
    micro-batch, at a sixteenth of it and twice that, once each
    (:data:`PLAN_REPEATS`) after a warm-up pass, fit ``peak = fixed +
    slope * cost`` (:func:`batch_cost`); ``fixed`` adds the optimizer
    state of the first step (:func:`optimizer_state_bytes`) and what the
    group and the callbacks keep. The loss check (``check_loss``) runs on
    their shapes. The plan, the largest cost that fits the budget (at most
    what ``RLIMIT_AS`` leaves) less :data:`PLAN_MARGIN`, the least over
    ranks, in even pieces (:func:`even_piece_rows`), is then tried beside a
    stand-in of that state, and cut to three quarters while the try fails
    to allocate; the line through the try may shrink it, or grow it with
    one more try (:func:`_refine`). Under ``RLIMIT_AS``, each shape no pass
    ran takes the code the larger pass compiled (:func:`_largest_piece_cost`),
    and a failed try halves. It goes to ``net.memory_plan_``. The passes
    leave no gradient, buffer (``buffers``, restored) or random state
    changed.

    Skipped until a first micro-batch of 2 rows or more.
    """
    engine = net.get_engine()
    start = time.perf_counter()
    first = next(iter(group.micro_batches()), None)  # the group keeps it
    rows = 0 if first is None else batch_len(first)
    if not engine.all_ranks(rows >= 2):
        return
    device = _device_of(net)
    budget = parse_budget(net.memory_budget)
    if budget is None:
        budget = available_memory(device)
    meter = PeakMemory(device)
    per_row = _cost_per_row(first)
    kept = (group.size - 1) * _nbytes(first) if group.keep else 0
    state = optimizer_state_bytes(net)
    with torch.random.fork_rng(
            devices=[device] if device.type == 'cuda' else []):
        trials, out_bytes, code = _trials(net, engine, meter, first,
                                          buffers, **fit_params)
        # on the larger pass's piece and its halves, the smaller's shape:
        # what the check maps (oneDNN's code for a new shape) is counted in
        # the address space read next, not met by the first step
        checking = time.perf_counter()
        net._check_loss_on(split_batch(first, trials[1][0])[0], **fit_params)
        check_seconds = time.perf_counter() - checking
        meter.reset()  # malloc hands back what the passes freed
        left = _address_space_left() if device.type == 'cpu' else None
        if left is not None and budget is not None:
            # the passes map more than they hold (caches of each shape, the
            # heap): under RLIMIT_AS, what is left of it bounds the plan
            budget = min(budget, max(0, meter.held()) + left)
        else:
            code = 0  # compiled code is address space, little of it resident
        code = -engine.min_over_ranks(-code)  # the same tries on every rank
        (cost_1, peak_1), (cost_2, peak_2) = [
            (size * per_row, peak) for size, peak in trials]
        slope = max(0.0, (peak_2 - peak_1) / (cost_2 - cost_1))
        if getattr(net, '_keep_train_y_pred_', False):
            kept += out_bytes * rows * group.size
        # max(0, held): the caches and thread pools of a first pass
        fixed = (max(0.0, peak_1 - slope * cost_1) + state + kept
                 + max(0, meter.held()))
        ran = [size for size, _ in trials]
        piece_cost = functools.partial(_largest_piece_cost, first, budget,
                                       code)
        max_cost = piece_cost(fixed, slope, ran)
        max_cost = engine.min_over_ranks(
            _NO_LIMIT if max_cost is None else max_cost)
        planned = even_piece_rows(rows, _rows_within(max_cost, per_row, rows))
        # beside the state and what is kept, half the margin: the try shows
        # its pass, not what a cap counts of later steps (address space)
        reserve = state + kept + int(PLAN_MARGIN / 2 * (budget or 0))
        tried, peak, failed = _verify(
            net, engine, meter, first, planned, reserve, buffers, ran=ran,
            code=code, **fit_params)
        if tried < planned:
            planned, max_cost = tried, math.ceil(tried * per_row)
        if planned * per_row > cost_1:
            line = (cost_1, peak_1, planned * per_row, peak)
            planned, max_cost, fixed, slope = _refine(
                net, engine, meter, first, line, piece_cost, fixed, slope,
                planned, max_cost, failed, reserve, buffers,
                ran=ran + sorted(_piece_shapes(rows, planned)), **fit_params)
    predicted = int(fixed + slope * planned * per_row)
    net.micro_batch_size_ = planned if planned < rows else None
    net.memory_plan_ = {
        'budget': budget,
        'unit': 'rows' if batch_cost(first) is None else 'elements',
        'micro_batch_size': planned,
        'max_cost': None if max_cost == _NO_LIMIT else max_cost,
        'fixed': int(fixed),
        'slope': slope,
        'predicted_peak': predicted,
        'measured_peak': None,
        # the loss check's, which a fit runs without a plan too, left out
        'plan_seconds': time.perf_counter() - start - check_seconds,
        'loss_check_seconds': check_seconds,
        'method': meter.method,
        'code_per_shape': code,
        'trials': [(cost_1, peak_1), (cost_2, peak_2)],
        'passes': meter.windows,
    }
    row = net._current_batch_row()
    if row is not None:
        row['memory_plan_predicted'] = predicted
    meter.reset()  # the first step's peak, above the same baseline
    net._memory_meter_ = meter


def _refine(net, engine, meter, first, line, piece_cost, fixed, slope,
            planned, max_cost, failed, reserve, buffers, ran, **fit_params):
    """Return the plan on the line through the try and the smaller pass.

    The peak of a small pass falls where a gradient is added, of a large
    one where the activations are largest, so two small passes can
    overstate what the plan's size takes. ``line``: ``(cost_1, peak_1,
    cost_t, peak_t)``. The plan shrinks if the try took more than the passes
    said. It grows with one more try if the line lets through fewer pieces
    of the micro-batch, with half the margin (a try measures what the margin
    is for), and less than the rows whose try ``failed``. ``piece_cost``:
    :func:`_largest_piece_cost` of the plan; ``ran``: the sizes of the
    passes so far. Returns ``(planned, max_cost, fixed, slope)``.
    """
    rows, per_row = batch_len(first), _cost_per_row(first)
    cost_1, peak_1, cost_t, peak_t = line
    slope_t = max(0.0, (peak_t - peak_1) / (cost_t - cost_1))
    fixed += (max(0.0, peak_1 - slope_t * cost_1)
              - max(0.0, peak_1 - slope * cost_1))
    cost = piece_cost(fixed, slope_t, ran, margin=PLAN_MARGIN / 2,
                      below=failed)
    cost = engine.min_over_ranks(_NO_LIMIT if cost is None else cost)
    grown = _rows_within(cost, per_row, rows)
    if failed is not None and grown >= failed:
        grown, cost = failed - 1, math.ceil((failed - 1) * per_row)
    grown = even_piece_rows(rows, grown)
    if grown < planned:  # the try took more than the passes said
        return grown, cost, fixed, slope_t
    # once, and only where it saves a pass (even pieces: larger ones are
    # fewer): each try costs one
    if grown > planned and _try(
            net, engine, meter, first, grown, reserve, buffers,
            **fit_params) is not None:
        # no more than the try passed where it took whole batches
        return grown, (cost if grown < rows else math.ceil(
            grown * per_row)), fixed, slope_t
    return planned, max_cost, fixed, slope_t


def largest_cost(budget, fixed, slope, margin=PLAN_MARGIN):
    """Return the largest cost per piece that the plan lets through.

    The largest whole ``cost`` with ``fixed + slope * cost`` at most
    ``budget`` less ``margin`` (by default :data:`PLAN_MARGIN`, 10%): 0 if
    ``fixed`` alone is more, None where nothing limits it (no budget, or no
    slope).

    Examples
    --------
    >>> largest_cost(budget=1000, fixed=100, slope=2)  # 100 + 2 * 400 = 900
    400

    """
    if budget is None:
        return None
    left = budget * (1 - margin) - fixed
    if left <= 0:
        return 0
    return None if slope <= 0 else int(left / slope)


def _largest_piece_cost(first, budget, code, fixed, slope, ran,
                        margin=PLAN_MARGIN, below=None):
    """Return the largest cost of ``first``'s pieces whose pass fits.

    As :func:`largest_cost`, with ``code`` bytes for each shape of the
    pieces (their size, the last piece's) that no pass ran (``ran``): a cap
    on the address space counts the code compiled for a new shape (oneDNN's
    convolutions). A size that ran, in even pieces, needs no margin: its
    peak was measured, not extrapolated, and its try (beside the state and
    half the margin) maps no new code, so a failed one costs a pass. With
    code, of pieces of fewer rows than ``below`` (a failed try's).
    """
    cost = largest_cost(budget, fixed, slope, margin)
    if not code or not cost:  # None: nothing limits it; 0: nothing fits
        return cost
    rows, per_row = batch_len(first), _cost_per_row(first)
    below = below or rows + 1

    def fits(size, margin):
        new = len(_piece_shapes(rows, size) - set(ran))
        return size < below and size * per_row <= largest_cost(
            budget, fixed + new * code, slope, margin)

    sizes = [size for size in ran if even_piece_rows(rows, size) == size
             and fits(size, 0)]
    # the largest new size: from the fewest pieces the budget allows
    for count in range(-(-rows // _rows_within(cost, per_row, rows)),
                       rows + 1):
        if fits(-(-rows // count), margin):
            sizes.append(-(-rows // count))
            break
    return math.ceil(max(sizes) * per_row) if sizes else 0


def _piece_shapes(rows, size):
    """Return the rows of the pieces of ``rows`` cut at ``size``: 1 or 2."""
    return {size, rows - (-(-rows // size) - 1) * size}


def record_measured_peak(net):
    """Record the peak of the first planned step, after it."""
    meter, net._memory_meter_ = getattr(net, '_memory_meter_', None), None
    if meter is None:
        return
    measured = net.memory_plan_['measured_peak'] = meter.peak()
    row = net._current_batch_row()
    if row is not None:
        row['memory_plan_measured'] = measured


_NO_LIMIT = 2 ** 62  # the plan's cost per piece when nothing limits it

_ONE_ROW = ("micro_batch_size='auto': a micro-batch of one row does not fit "
            "in memory; use a smaller model or less data per row.")


def _device_of(net):
    module = getattr(net, 'module_', None)
    param = next(module.parameters(), None) if module is not None else None
    return param.device if param is not None else torch.device(net.device)


def _passes(net, engine, pieces, buffers, reserve=0, **fit_params):
    """Run ``_trial`` on each ``(piece, meter)``; None for a failed one.

    The same passes on every rank (DDP's forward may broadcast, FSDP2's
    gathers): a rank whose pass fails joins the others' collectives
    (``join_plan_pass``), and all of them stop.
    """
    results = []
    for piece, meter in pieces:
        result, held = None, None
        try:
            # the optimizer state and what is kept, as in the step (an
            # untouched block, which the address space counts)
            held = torch.empty(reserve, dtype=torch.uint8,
                               device=_device_of(net)) if reserve else None
            result = _trial(net, engine, meter, piece, **fit_params)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        del held
        # outside the except block, whose traceback holds the pass's tensors
        if result is None:
            engine.join_plan_pass(functools.partial(
                _trial, net, engine, meter, **fit_params), piece)
        if not engine.all_ranks(result is not None):
            results.append(None)  # on every rank
            break
        results.append(result)
    net._zero_grad_optimizer()
    restore_buffers(buffers or ())
    return results


def _trials(net, engine, meter, first, buffers, **fit_params):
    """Return the two measured ``(rows, peak)``, outputs' bytes, new code.

    The outputs' bytes per row; the code compiled from the first larger
    pass on, the first of its shape (:func:`compiled_code_bytes`). Halves
    the sizes while a pass fails. The largest of each size's peaks counts:
    on the CPU, malloc takes more or less for the same tensors.
    """
    small = max(1, batch_len(first) // 16)
    while True:
        sizes = [small, 2 * small]
        order = [sizes[0]] + sizes * PLAN_REPEATS  # the first warms up
        larger = order.index(sizes[1])
        results = _passes(net, engine, [
            (split_batch(first, size)[0], meter) for size in order[:larger]],
            buffers, **fit_params)
        code = compiled_code_bytes()  # read twice a plan: it takes ms
        if None not in results:
            results += _passes(net, engine, [
                (split_batch(first, size)[0], meter)
                for size in order[larger:]], buffers, **fit_params)
        if None not in results:
            peaks = [max(peak for (size_, peak, _) in results[1:]
                         if size_ == size) for size in sizes]
            return (list(zip(sizes, peaks)), results[-1][2] / sizes[1],
                    compiled_code_bytes() - code)
        if small == 1:
            raise RuntimeError(_ONE_ROW)
        small //= 2


def _verify(net, engine, meter, first, planned, reserve, buffers, ran=(),
            code=0, **fit_params):
    """Return the rows of a try that passed, its peak, the last that failed.

    From the planned rows, less a quarter while a try fails (None: none
    failed; half where each new shape maps ``code`` bytes: fewer tries),
    or the most rows below it of a pass that ran (``ran``), if more; in
    even pieces (:func:`even_piece_rows`). Where the budget is
    the device's or a hard limit's, the measured peak can miss what a cap
    counts (the CPU's address space grows more than its resident memory):
    one pass at the plan, beside ``reserve`` bytes, settles it.
    """
    failed, rows = None, batch_len(first)
    ran = [size for size in ran if even_piece_rows(rows, size) == size]
    while True:
        peak = _try(net, engine, meter, first, planned, reserve, buffers,
                    **fit_params)
        if peak is not None:
            return planned, peak, failed
        if planned == 1:
            raise RuntimeError(_ONE_ROW)
        # a try that fails was close: smaller steps than the back-off's,
        # unless each new shape maps code that a cap counts (oneDNN's); a
        # shape that ran maps no more
        smaller = planned // 2 if code else min(planned - 1, planned * 3 // 4)
        failed, planned = planned, max([even_piece_rows(rows, smaller)] + [
            size for size in ran if size < planned])


def _try(net, engine, meter, first, rows, reserve, buffers, **fit_params):
    """Return the peak of a pass on ``rows`` rows beside ``reserve`` bytes.

    And of a pass on the last piece of ``first`` in pieces of ``rows``,
    where its rows differ on some rank and the module has convolutions: a
    cap counts the code oneDNN compiles for each of their new shapes (a
    smaller piece of matrix products takes no more). None where a pass
    fails to allocate, on any rank.
    """
    pieces = split_batch(first, rows)
    last = pieces[-1] if (batch_len(pieces[-1]) != rows
                          and _has_convolutions(net.module_)) else None
    # the same passes on every rank, for the collectives of each
    pieces = pieces[:1] + ([] if engine.all_ranks(last is None)
                           else [pieces[0] if last is None else last])
    results = _passes(net, engine, [(piece, meter) for piece in pieces],
                      buffers, reserve, **fit_params)
    return None if None in results else max(peak for _, peak, _ in results)


_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                 torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
                 torch.nn.ConvTranspose3d)


def _has_convolutions(module):
    """Whether ``module`` has a convolution layer (oneDNN's, on the CPU)."""
    return any(isinstance(layer, _CONVOLUTIONS) for layer in module.modules())


def _trial(net, engine, meter, piece, **fit_params):
    """Run forward and backward on ``piece``; return its peak and outputs.

    As a piece after the first of a step: its gradients are added to those
    held, so each parameter's new gradient is held beside them for a while.
    """
    params = [param for _, param in net.get_all_learnable_params()
              if param.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    with meter.window():
        with engine.plan_context(), net.autocast():
            step = net.train_step_single(piece, **fit_params)
        # with the gradients the step holds before the window
        peak = meter.peak(start=True) + engine.plan_gradient_bytes(params)
    return (batch_len(piece), peak,
            _nbytes(step.get('y_pred') if isinstance(step, dict) else None))


def optimizer_state_bytes(net):
    """Return the bytes of state the optimizers create at their first step.

    0 for an optimizer that holds state already. Else a zero stand-in of
    each shape of parameter steps once in a new optimizer of the same class
    and settings, and its state is counted; twice the parameters' bytes
    (Adam's) for an optimizer that cannot be made so.
    """
    total, known = 0, {}
    for name in net._optimizers:
        optimizer = getattr(net, name + '_', None)
        # a wrapper such as Accelerate's AcceleratedOptimizer
        while isinstance(getattr(optimizer, 'optimizer', None),
                         torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        if optimizer is None or len(optimizer.state):
            continue
        for index, group in enumerate(optimizer.param_groups):
            settings = {key: value for key, value in group.items()
                        if key != 'params'}
            for param in group['params']:
                key = (index, tuple(param.shape), param.dtype, param.device)
                if key not in known:
                    known[key] = _state_bytes(type(optimizer), settings, param)
                total += known[key]
    return total


def _state_bytes(cls, settings, param):
    standin = torch.zeros_like(param.detach()).requires_grad_()
    standin.grad = torch.zeros_like(standin)
    try:
        probe = cls([dict(settings, params=[standin])])
        probe.step()
    except Exception:  # noqa: BLE001 (a class that needs more arguments)
        return 2 * _nbytes(param)
    return sum(_nbytes(value) for value in probe.state[standin].values()
               if isinstance(value, torch.Tensor) and value.device == param.device)


# The back-off

_OUT_OF_MEMORY_ERRORS = (torch.cuda.OutOfMemoryError,) + (
    (torch.OutOfMemoryError,) if hasattr(torch, 'OutOfMemoryError') else ())

# in the RuntimeError of torch's CPU allocator when malloc fails, of
# oneDNN when a convolution's workspace cannot be allocated, and of C++'s
# new (autograd's engine, under RLIMIT_AS)
CPU_ALLOCATOR_ERROR = "DefaultCPUAllocator: can't allocate memory"
ONEDNN_ERROR = 'could not create a primitive'
CPP_ALLOCATION_ERROR = 'std::bad_alloc'


def is_out_of_memory(error):
    """Whether ``error`` is an allocation failure of CUDA or the CPU.

    CUDA's out-of-memory error, or a RuntimeError of torch's CPU allocator,
    of oneDNN (``could not create a primitive``) or of C++
    (``std::bad_alloc``).

    Examples
    --------
    >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate "
    ...                               "memory: you tried to allocate 8 bytes"))
    True

    """
    return isinstance(error, _OUT_OF_MEMORY_ERRORS) or (
        isinstance(error, RuntimeError)
        and any(text in str(error) for text in (
            CPU_ALLOCATOR_ERROR, ONEDNN_ERROR, CPP_ALLOCATION_ERROR)))


def backs_off(error):
    """Whether ``micro_batch_size='auto'`` backs off after ``error``.

    CUDA's, and the CPU's raised in a pass (``in_pass``, set by the net):
    one raised while a micro-batch was loaded would lose it in the replay.
    """
    return (isinstance(error, _OUT_OF_MEMORY_ERRORS)
            or getattr(error, 'in_pass', False))


def backed_off_size(group):
    """Return half the rows of the piece that ran out of memory."""
    rows = group.rows_in_flight
    current = min(getattr(group, 'piece_rows', None) or rows, rows)
    if current <= 1:
        raise RuntimeError(_ONE_ROW)
    return (current + 1) // 2


def back_off(net, group, buffers, size=None):
    """Halve the pieces after an out-of-memory error and start again.

    With no gradient and the buffers of before the group. ``size``: the
    size all ranks agreed on, if another rank failed. A plan's cost per
    piece becomes that of the new size: it was wrong.
    """
    net._zero_grad_optimizer()
    restore_buffers(buffers or ())
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    net.micro_batch_size_ = size or backed_off_size(group)
    plan = getattr(net, 'memory_plan_', None)
    if plan is not None and plan['max_cost'] is not None:
        plan['max_cost'] = math.ceil(net.micro_batch_size_ * getattr(
            group, 'cost_per_row', 1.0))
    # each back-off once, in the row of the batch that backed off
    row = net.history[-1]['batches'][-1]
    row['micro_batch_size_backoff'] = row.get(
        'micro_batch_size_backoff', []) + [net.micro_batch_size_]
