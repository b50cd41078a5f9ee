"""Split a batch into micro-batches and join their outputs again.

These helpers know the shapes of data that skorch's iterators yield: usually
a pair ``(X, y)`` whose members are tensors, numpy arrays, pandas objects, or
dicts and lists/tuples of those. Splitting is done with
:func:`skorch.utils.multi_indexing`, so tensors are split into views and no
data is copied. :func:`is_positive_int` checks a number of micro-batches or
rows.
"""

import numbers

import torch
from skorch.dataset import get_len
from skorch.utils import multi_indexing

__all__ = ['batch_len', 'concat_outputs', 'detach_outputs', 'is_positive_int',
           'split_batch']


def batch_len(batch):
    """Return the number of rows in a batch, the way skorch counts them.

    Examples
    --------
    >>> import torch
    >>> batch_len((torch.zeros(5, 2), torch.zeros(5)))
    5

    """
    if isinstance(batch, (tuple, list)):
        return get_len(batch[0])
    return get_len(batch)


def split_batch(batch, micro_batch_size):
    """Split a batch into consecutive micro-batches.

    Parameters
    ----------
    batch : tuple, list, or data
      A batch as yielded by the net's iterator, usually ``(X, y)``. Each
      member of a tuple or list (e.g. also ``(X, y, sample_weight)``) is
      split along its first axis; ``None`` members stay ``None``.

    micro_batch_size : int
      The largest number of rows in one micro-batch.

    Returns
    -------
    micro_batches : list
      The micro-batches, each of the same structure as ``batch``. Every row
      of ``batch`` is in exactly one of them, in the original order; all but
      the last hold ``micro_batch_size`` rows.

    Examples
    --------
    >>> import torch
    >>> X, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    >>> [len(Xi) for Xi, yi in split_batch((X, y), 2)]
    [2, 2, 1]

    """
    micro_batches = []
    for start in range(0, batch_len(batch), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        if isinstance(batch, (tuple, list)):
            micro_batches.append(type(batch)(
                None if data is None else multi_indexing(data, rows)
                for data in batch))
        else:
            micro_batches.append(multi_indexing(batch, rows))
    return micro_batches


def _apply(fn, outputs):
    """Apply ``fn`` to parallel lists of tensors in nested outputs."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        shapes = {tuple(out.shape[1:]) for out in outputs}
        if fn is torch.cat and len(shapes) > 1:
            raise ValueError(
                "Cannot join the outputs of micro-batches whose shapes differ "
                "beyond the first axis: {}. Outputs of dynamically padded "
                "micro-batches cannot form one batch; read them per "
                "micro-batch instead.".format(
                    sorted(tuple(out.shape) for out in outputs)))
        return fn(outputs)
    if isinstance(first, dict):
        return {key: _apply(fn, [out[key] for out in outputs]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(
            _apply(fn, [out[i] for out in outputs]) for i in range(len(first)))
    raise TypeError(
        "Cannot join module outputs of type {}; return tensors, or dicts, "
        "tuples or lists of tensors from the module's forward.".format(
            type(first).__name__))


def detach_outputs(output):
    """Detach a module output (a tensor or a nest of tensors) from its graph.

    Examples
    --------
    >>> import torch
    >>> w = torch.ones(2, requires_grad=True)
    >>> detach_outputs((w * 2, {'a': w * 3}))[1]['a'].requires_grad
    False

    """
    return _apply(lambda tensors: tensors[0].detach(), [output])


def concat_outputs(outputs):
    """Concatenate the outputs of several micro-batches along the first axis.

    Parameters
    ----------
    outputs : list
      The module outputs of the micro-batches, in order. Each is a tensor, or
      a dict, tuple or list of tensors with the same structure.

    Returns
    -------
    output
      One output of the same structure, as the module would have returned
      for the whole batch; the output itself if there is only one.

    Examples
    --------
    >>> import torch
    >>> concat_outputs([torch.zeros(2, 3), torch.ones(1, 3)]).shape
    torch.Size([3, 3])

    """
    if len(outputs) == 1:
        return outputs[0]  # not copied
    return _apply(torch.cat, outputs)


def is_positive_int(value):
    """Whether ``value`` is an integer of at least 1, and not a bool."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and value >= 1)
