"""Memory measured: what a process adds, a device gives, backward saves.

:class:`MemoryMeter` measures the memory a process adds from a moment on,
as containers and GPUs count it: on the CPU, resident memory, which a
container's cgroup limits; on CUDA, what torch's caching allocator
reserves. :func:`available_memory` reads what a device still gives, and
:func:`fix_malloc_threshold` and :func:`tensors_off_the_heap` keep glibc's
malloc from holding on to what tensors free; the plan of
``micro_batch_size='auto'`` (:mod:`skorch_gradacc.memory`) uses them.
:func:`track_activation_memory` counts the tensors autograd saves for
backward: the activation memory that smaller micro-batches shrink.
"""

import contextlib
import ctypes
import ctypes.util
import os

import torch

__all__ = ['ActivationMemory', 'MemoryMeter', 'available_memory',
           'fix_malloc_threshold', 'tensors_off_the_heap',
           'track_activation_memory']

# the mmap threshold fix_malloc_threshold sets, half glibc's default: blocks
# of 64 to 128 KiB (a recurrent net's states at some rows) on the heap made
# peaks, and so plans, differ between processes (the benchmark's column
# at 128 KiB); off it, they go back to the OS when freed, at a syscall each
MALLOC_THRESHOLD = 64 * 2 ** 10


def available_memory(device):
    """Return the bytes this process can still take on ``device``.

    * CUDA: the device's free memory (``torch.cuda.mem_get_info``) plus what
      torch's caching allocator holds reserved but unused, and at most what
      ``torch.cuda.set_per_process_memory_fraction`` leaves;
    * CPU: the lesser of the cgroup's ``memory.max`` (v1:
      ``memory.limit_in_bytes``) less its usage, and ``MemAvailable`` of
      ``/proc/meminfo``.

    None where none of them can be read (another device, another OS).

    Examples
    --------
    >>> available_memory('cpu') > 0  # on Linux
    True

    """
    device = _indexed(device)
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
    limits = [limit for limit in (_status_bytes('/proc/meminfo').get('MemAvailable'),
                                  _cgroup_headroom()) if limit is not None]
    return max(0, min(limits)) if limits else None


def _indexed(device):
    """Return ``device`` with CUDA's index, the allocator's fraction's."""
    device = torch.device(device)
    if device.type == 'cuda' and device.index is None:
        return torch.device('cuda', torch.cuda.current_device())
    return device


@contextlib.contextmanager
def reserved_memory_cap(device, nbytes):
    """Cap what torch's caching allocator reserves on a CUDA ``device``.

    At what it reserves now, its cache emptied, plus ``nbytes``, through
    ``torch.cuda.set_per_process_memory_fraction``; a lower fraction the
    process set stays, and it is restored after. Past the cap an allocation
    raises CUDA's out-of-memory error, which a plan's pass and the back-off
    catch, and cuDNN picks a convolution whose workspace fits: a budget the
    fit keeps, as a cgroup keeps one on the CPU. Nothing on other devices,
    with ``nbytes`` None, or where torch cannot read the fraction to
    restore it (``get_per_process_memory_fraction``, in newer torch).
    """
    device = _indexed(device)
    fraction = getattr(torch.cuda, 'get_per_process_memory_fraction', None)
    if device.type != 'cuda' or nbytes is None or fraction is None:
        yield
        return
    before = fraction(device)
    torch.cuda.empty_cache()  # free blocks cached are not the fit's
    total = torch.cuda.get_device_properties(device).total_memory
    capped = (torch.cuda.memory_reserved(device) + nbytes) / total
    torch.cuda.set_per_process_memory_fraction(min(before, capped), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def memory_settings(device, budget):
    """Return what a fit with ``micro_batch_size='auto'`` sets in the process.

    A context: on the CPU :func:`tensors_off_the_heap`, on CUDA
    :func:`reserved_memory_cap` at ``budget`` (bytes, or None).
    """
    if torch.device(device).type == 'cpu':
        return tensors_off_the_heap()
    return reserved_memory_cap(device, budget)


def _status_bytes(path='/proc/self/status'):
    """Return the ``key: N kB`` lines of a /proc file, in bytes."""
    try:
        with open(path) as lines:
            return {key: int(value.split()[0]) * 1024 for key, _, value in (
                line.partition(':') for line in lines) if value.endswith('kB\n')}
    except OSError:
        return {}


# the memory controller's folder and its files of limit and usage, by the
# controllers named in /proc/self/cgroup: v2 (none named) and v1
_CGROUPS = {'': ('/sys/fs/cgroup', 'memory.max', 'memory.current'),
            'memory': ('/sys/fs/cgroup/memory', 'memory.limit_in_bytes',
                       'memory.usage_in_bytes')}


def _read(path):
    with open(path) as file:
        return file.read().strip()


def _cgroup_headroom():
    """Return the process's cgroup memory limit minus its usage, or None."""
    try:
        with open('/proc/self/cgroup') as lines:
            entries = [line.rstrip('\n').split(':', 2) for line in lines]
    except OSError:
        return None
    for _, controllers, path in entries:
        key = '' if not controllers else 'memory' if 'memory' in controllers.split(
            ',') else None
        root, *names = _CGROUPS.get(key, (None,))
        # in a cgroup namespace, the mount is the process's cgroup
        for folder in ([root + path, root] if root else []):
            try:
                limit, usage = (_read(os.path.join(folder, name)) for name in names)
            except OSError:
                continue
            # 'max', or v1's largest page-aligned number: no limit
            return None if limit == 'max' or int(limit) >= 2 ** 60 else (
                int(limit) - int(usage))
    return None


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    except OSError:
        return None
    return libc if hasattr(libc, 'malloc_trim') else None  # glibc's


_LIBC = _load_libc()
if _LIBC is not None:
    _LIBC.malloc.restype, _LIBC.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    _LIBC.free.argtypes = [ctypes.c_void_p]
    _LIBC.sbrk.restype, _LIBC.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]


def _load_mkl_free_buffers():
    """Return MKL's ``mkl_free_buffers``, where torch links MKL in, or None.

    torch links MKL statically and exports it by its service name.
    """
    path = os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so')
    try:
        return ctypes.CDLL(path).mkl_serv_free_buffers
    except (OSError, AttributeError):
        return None


_MKL_FREE_BUFFERS = _load_mkl_free_buffers()
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's options


def fix_malloc_threshold():
    """Fix glibc's mmap threshold at 64 KiB; whether it did.

    glibc gives each block above the threshold a mapping of its own, which
    ``free`` returns to the OS, and raises the threshold to each such block
    it frees: later tensors then come from the heap, which keeps what they
    free, and resident memory grows with what ran before (twice what the
    tensors take, in some fits). From this call on, for the whole process,
    the threshold (and the heap's trim threshold) stays at
    ``MALLOC_THRESHOLD``, as with ``MALLOC_MMAP_THRESHOLD_=65536``. A fit with
    ``micro_batch_size='auto'`` on the CPU calls it. Nothing is changed
    where the process set the thresholds itself (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` or their ``GLIBC_TUNABLES``, as it started)
    or where malloc is not glibc's.

    Examples
    --------
    >>> fix_malloc_threshold() in (True, False)
    True

    """
    environ = _startup_environ()
    if _LIBC is None or 'MALLOC_MMAP_THRESHOLD_' in environ or (
            'MALLOC_TRIM_THRESHOLD_' in environ) or 'threshold' in environ.get(
                'GLIBC_TUNABLES', ''):
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, MALLOC_THRESHOLD)
                and _LIBC.mallopt(_M_TRIM_THRESHOLD, MALLOC_THRESHOLD))


@contextlib.contextmanager
def tensors_off_the_heap():
    """Give tensors of 64 KiB or more mappings of their own, for a while.

    :func:`fix_malloc_threshold`, then, where it did, holds the heap's free
    blocks of at least the threshold, untouched (their pages given back
    first), until the end. What a threshold that had moved left there
    (free blocks of a process that held large arrays before) would take
    such tensors, and keep them resident after they are freed, so resident
    memory would depend on where each one landed: the peaks of passes at the
    same rows, in one process, would differ by a tensor's size, now and
    then. A mapping of its own goes back to the OS when freed. Under a
    limit of address space (``RLIMIT_AS``) it holds none. A fit with
    ``micro_batch_size='auto'`` on the CPU does this.

    Examples
    --------
    >>> with tensors_off_the_heap():
    ...     x = torch.ones(2 ** 20)
    >>> float(x.sum())
    1048576.0

    """
    blocks = _take_free_heap_blocks() if fix_malloc_threshold() else []
    try:
        yield
    finally:
        for block in blocks:
            _LIBC.free(block)


def _take_free_heap_blocks():
    """Take the heap's free blocks of ``MALLOC_THRESHOLD`` or more.

    Blocks that malloc gives below the program break without moving it (a
    mapping of its own or a heap grown go back), from the threshold up,
    twice the size after each, half after each miss. None under a limit of
    address space or data: they would take the limit's room, and an
    allocation that fails while oneDNN compiles a kernel leaves every later
    kernel on that thread failing (later fits failed; oneDNN PR 5907). A
    thread's own arena keeps its blocks.
    """
    import resource  # Unix's, as glibc is

    if any(resource.getrlimit(limit)[0] != resource.RLIM_INFINITY
           for limit in (resource.RLIMIT_AS, resource.RLIMIT_DATA)):
        return []
    _LIBC.malloc_trim(0)  # first: the pages of blocks held stay given back
    blocks, size = [], MALLOC_THRESHOLD
    while size >= MALLOC_THRESHOLD:
        end = _LIBC.sbrk(0)
        block = _LIBC.malloc(size)
        if block and block < end == _LIBC.sbrk(0):
            blocks.append(block)
            size *= 2
        else:
            _LIBC.free(block)
            size //= 2
    return blocks


def _startup_environ():
    """Return the environment the process started with, which malloc read.

    Not ``os.environ``: what a library sets there later (Dask's Nanny sets
    ``MALLOC_TRIM_THRESHOLD_`` before it starts a worker) changes nothing
    for this process's malloc.
    """
    try:
        with open('/proc/self/environ', 'rb') as environ:
            items = environ.read().decode(errors='replace').split('\0')
    except OSError:
        return os.environ
    return dict(item.partition('=')[::2] for item in items if item)


class MemoryMeter:
    """The memory a fit adds on a device, as containers and GPUs count it.

    Counted from the moment the meter is made: on the CPU, anonymous
    resident memory (``RssAnon``; peaks from ``VmHWM``, less the pages of
    files mapped, which the kernel can reclaim), on CUDA, what torch's
    caching allocator reserves. :meth:`reset` starts a window, after
    giving back what malloc or the cache hold unused; :meth:`peak` is the
    window's peak, :meth:`held` what is held now and :meth:`highest` the
    peak of all windows. ``method`` is ``'rss'``, ``'cuda'`` or None where
    neither can be read (then nothing is planned).

    Parameters
    ----------
    device : str or torch.device
      The device whose memory is measured.

    Examples
    --------
    >>> import torch
    >>> meter = MemoryMeter('cpu')
    >>> x = torch.ones(2 ** 24)  # 64 MiB: over any mmap threshold glibc moves to
    >>> meter.peak() >= 64 * 2 ** 20 - 2 ** 16  # on Linux
    True

    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.method = 'cuda' if self.device.type == 'cuda' else (
            'rss' if _reset_rss_peak() else None)
        self._start_window()
        self.baseline, self._highest = self._now(), 0
        self.available = available_memory(self.device)

    def _now(self):
        if self.method == 'cuda':
            return torch.cuda.memory_reserved(self.device)
        return _status_bytes().get('RssAnon', 0)

    def held(self):
        """Return the bytes held now above the meter's start."""
        return self._now() - self.baseline

    def peak(self):
        """Return the window's peak bytes above the meter's start."""
        if self.method == 'cuda':
            peak = torch.cuda.max_memory_reserved(self.device)
        elif self.method == 'rss':
            status = _status_bytes()
            peak = status['VmHWM'] - status['VmRSS'] + status['RssAnon']
        else:
            return 0
        return max(0, peak - self.baseline)

    def highest(self):
        """Return the peak of every window so far."""
        return max(self._highest, self.peak())

    def reset(self, release=False):
        """Start a new window: its peak is what is held now.

        With ``release``, first what the process holds free goes back
        (:meth:`release`), which passes measured next would reuse unseen.
        """
        self._highest = self.highest()
        if release:
            self.release()
        self._start_window()

    def release(self):
        """Give the OS what the process holds free, on the CPU.

        MKL's buffers kept for reuse (``mkl_free_buffers``: it keeps some
        for each size of matrix product, so passes at many sizes would
        leave a fit holding tens of MiB for sizes it never runs), then
        malloc's free memory (``malloc_trim``): the heap keeps freed blocks
        resident, and later tensors that land elsewhere add to them.
        """
        if self.device.type != 'cpu':
            return
        if _MKL_FREE_BUFFERS is not None:
            _MKL_FREE_BUFFERS()
        if _LIBC is not None:
            _LIBC.malloc_trim(0)

    def _start_window(self):
        if self.method == 'cuda':
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == 'rss':
            _reset_rss_peak()


def _reset_rss_peak():
    """Reset VmHWM to the resident memory now; whether it worked."""
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
    except OSError:
        return False
    return 'VmHWM' in _status_bytes()


# The bytes saved for backward

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
