"""Measure the peak memory held by tensors saved for backward.

On the CPU there is no allocator peak to read, and the process's peak RSS
cannot be reset. What accumulation saves is activation memory: the tensors
that autograd keeps from the forward pass until ``backward``. This module
counts exactly those, deterministically, on any device. The demo, the
benchmarks and the notebook use it.
"""

import contextlib

import torch

__all__ = ['ActivationMemory', 'track_activation_memory']


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
