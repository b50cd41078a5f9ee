"""Batches, their lengths and their pieces, and the run they flow through.

The data is what skorch's iterators yield: usually ``(X, y)`` whose members
are tensors, arrays, pandas objects, or dicts and sequences of those.
:func:`split_batch` makes views (:func:`skorch.utils.multi_indexing`), never
copies. The checks, the ranks and :func:`uncompiled` here are shared by the
package's modules.
"""

import copy
import numbers
import os
import sys
from pathlib import Path

import joblib
import numpy as np
import sklearn
import torch
from skorch.dataset import get_len
from skorch.utils import multi_indexing

__all__ = ['planned_above', 'planned_rows']


def batch_len(batch):
    """Return the number of rows in a batch, the way skorch counts them."""
    if isinstance(batch, (tuple, list)):
        return get_len(batch[0])
    return get_len(batch)


def split_batch(batch, micro_batch_size):
    """Split a batch into consecutive pieces of ``micro_batch_size`` rows.

    Each member of a tuple or list batch is split along its first axis;
    ``None`` members stay ``None``.

    Examples
    --------
    >>> import torch
    >>> X, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    >>> [len(Xi) for Xi, yi in split_batch((X, y), 2)]
    [2, 2, 1]

    """
    return [take_rows(batch, slice(start, start + micro_batch_size))
            for start in range(0, batch_len(batch), micro_batch_size)]


def take_rows(batch, rows):
    """Return the rows (a slice) of a batch, as :func:`split_batch` does.

    As skorch indexes data (:func:`skorch.utils.multi_indexing`), but a
    list or tuple of one item per row (what a ``collate_fn`` may give, e.g.
    targets of different lengths) is sliced itself, not taken for columns.

    Examples
    --------
    >>> import torch
    >>> X, y = torch.zeros(3, 2), [torch.ones(5), torch.ones(1), torch.ones(2)]
    >>> [len(target) for target in take_rows((X, y), slice(1, 3))[1]]
    [1, 2]

    """
    if isinstance(batch, (tuple, list)):
        n = batch_len(batch)
        return type(batch)(_take(data, rows, n) for data in batch)
    return multi_indexing(batch, rows)


def _is_per_row(data, n):
    """Whether a list or tuple holds ``n`` items, one per row, not columns.

    skorch's columns (``[X1, X2]``) each have ``n`` rows themselves.
    """
    if not isinstance(data, (tuple, list)) or len(data) != n:
        return False
    try:
        return not all(not isinstance(item, (str, bytes)) and get_len(item) == n
                       for item in data)
    except (TypeError, ValueError):  # an item without a length
        return True


def _take(data, rows, n):
    if data is None:
        return None
    return data[rows] if _is_per_row(data, n) else multi_indexing(data, rows)


def arrays_in(data):
    """Yield the tensors and arrays of ``data``, or of its dicts and sequences.

    Examples
    --------
    >>> import torch
    >>> [len(x) for x in arrays_in(({'ids': torch.ones(3), 'n': 2}, [np.ones(4)]))]
    [3, 4]

    """
    if isinstance(data, (torch.Tensor, np.ndarray)):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from arrays_in(value)
    elif isinstance(data, (tuple, list)):
        for value in data:
            yield from arrays_in(value)


def zero_rows(batch, n=None):
    """Return a batch of the same structure and trailing shapes, with 0 rows.

    It holds no reference to ``batch``'s data: the padding of a rank
    without a piece (:func:`padding_batch`).

    Examples
    --------
    >>> import torch
    >>> X, y = zero_rows((torch.ones(4, 3), torch.zeros(4)))
    >>> X.shape, y.shape
    (torch.Size([0, 3]), torch.Size([0]))

    """
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return batch[:0].clone()
    if isinstance(batch, dict):
        return type(batch)((key, zero_rows(value))
                           for key, value in batch.items())
    if n is not None and _is_per_row(batch, n):
        return type(batch)()
    if isinstance(batch, (tuple, list)):
        n = batch_len(batch) if n is None else n
        return type(batch)(zero_rows(data, n) for data in batch)
    empty = multi_indexing(batch, slice(0, 0))
    return empty.copy() if isinstance(empty, np.ndarray) else empty


class _PaddingDict(dict):
    """The zero-row ``X`` of a padding batch given as a dict, with its rows."""

    stand_in_ = None


def padding_batch(batch):
    """Return a batch of zero rows of ``batch``'s structure, for padding.

    Its ``X`` (the first member of a tuple or list, else the batch), a
    tensor or a dict, holds the first two rows of ``batch``'s ``X`` (one if
    it has one) as ``stand_in_`` (a copy: not the batch), which
    :class:`~skorch_gradacc.engine.PaddingMixin` runs the module on.
    Another ``X`` holds none.

    Examples
    --------
    >>> import torch
    >>> X, y = padding_batch((torch.ones(4, 3), torch.zeros(4)))
    >>> X.shape, y.shape, X.stand_in_.shape
    (torch.Size([0, 3]), torch.Size([0]), torch.Size([2, 3]))

    """
    empty = zero_rows(batch)
    is_pair = isinstance(batch, (tuple, list))
    X, empty_X = (batch[0], empty[0]) if is_pair else (batch, empty)
    if isinstance(empty_X, dict):
        empty_X = _PaddingDict(empty_X)
    if isinstance(empty_X, (torch.Tensor, _PaddingDict)) and (
            stand_in := _first_rows(X)) is not None:
        empty_X.stand_in_ = stand_in
    if not is_pair:
        return empty_X
    return type(batch)([empty_X, *empty[1:]])


def _first_rows(X):
    """Return a copy of the first two rows of ``X`` (a tensor or a dict of them).

    None for another ``X``, or one without rows.
    """
    values = X.values() if isinstance(X, dict) else [X]
    if not all(isinstance(value, torch.Tensor) and value.dim() and len(value)
               for value in values):
        return None
    if isinstance(X, dict):
        return {key: value[:2].clone() for key, value in X.items()}
    return X[:2].clone()


def _apply(fn, outputs, per_row=None):
    """Apply ``fn`` to parallel lists of tensors in nested outputs.

    Another leaf (a Hugging Face model's cache) is kept as it is from one
    output; from several, the same object of every one, else None: the
    pieces' caches make none of the whole. Sequences for which ``per_row``
    is true are joined into one.
    """
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return fn(outputs)
    if isinstance(first, dict):  # of its own class (Hugging Face's ModelOutput)
        joined = copy.copy(first)
        for key in first:
            joined[key] = _apply(fn, [out[key] for out in outputs], per_row)
        return joined
    if per_row is not None and per_row(outputs):
        return type(first)(item for out in outputs for item in out)
    if isinstance(first, (tuple, list)):
        return type(first)(_apply(fn, [out[i] for out in outputs], per_row)
                           for i in range(len(first)))
    return first if all(out is first for out in outputs) else None


def cast_outputs(output, dtype):
    """Return a module output with its floating-point tensors in ``dtype``."""
    return _apply(lambda tensors: tensors[0].to(dtype)
                  if tensors[0].is_floating_point() else tensors[0], [output])


def detach_outputs(output):
    """Detach a module output (a tensor or a nest of tensors) from its graph."""
    return _apply(lambda tensors: tensors[0].detach(), [output])


def output_rows(output, rows, n_rows):
    """Return the rows (a slice) of a module output of ``n_rows``, on the CPU.

    Of the output's own classes, as :func:`concat_outputs` keeps them: a
    Hugging Face ``ModelOutput`` stays one. A tensor whose first axis is not
    the rows is cut along the first that is (an RNN's state), as
    :func:`concat_outputs` joins it.

    Examples
    --------
    >>> import torch
    >>> output_rows((torch.arange(6).reshape(3, 2),), slice(1, 3), 3)
    (tensor([[2, 3],
            [4, 5]]),)
    >>> output_rows(torch.zeros(2, 3, 4), slice(1, 3), 3).shape
    torch.Size([2, 2, 4])

    """
    def cut(tensors):
        if tensors[0].dim() == 0:  # a loss, not per row: whole
            return tensors[0].cpu()
        axis = _rows_axis(tensors, [n_rows])
        return tensors[0][(slice(None),) * axis + (rows,)].cpu()
    return _apply(cut, [output])


def outputs_of_no_rows(output):
    """Return a module output cut to zero rows, on its device, in its graph.

    A 0-d tensor (a loss) is not per row: kept.
    """
    return _apply(lambda tensors: tensors[0][:0] if tensors[0].dim()
                  else tensors[0], [output])


def concat_outputs(outputs, rows):
    """Concatenate the outputs of several pieces along their ``rows``.

    Each output is a tensor, or a dict, tuple or list of tensors with the
    same structure; a single one is returned as it is, not copied. ``rows``:
    each piece's, its ``batch_len``. A 0-d float tensor (a loss, which is
    not per row) becomes the pieces' mean, weighted by their rows; another,
    the last piece's. Among tensors of rows, a 0-d one is a row (a one-row
    piece's output, squeezed). A tensor whose first axis is not the pieces' rows
    joins along the first that is (an RNN's state), and a list of one item
    per row, as :func:`take_rows` cuts it, is joined as a list.

    Examples
    --------
    >>> import torch
    >>> concat_outputs([torch.zeros(2, 3), torch.ones(1, 3)], [2, 1]).shape
    torch.Size([3, 3])
    >>> concat_outputs([(torch.zeros(2), torch.tensor(1.)),
    ...                 (torch.zeros(6), torch.tensor(3.))], [2, 6])
    (tensor([0., 0., 0., 0., 0., 0., 0., 0.]), tensor(2.5000))
    >>> concat_outputs([torch.zeros(3), torch.tensor(1.)], [3, 1])
    tensor([0., 0., 0., 1.])
    >>> concat_outputs([(torch.zeros(2, 3, 4), torch.zeros(3)),
    ...                 (torch.zeros(2, 1, 4), torch.zeros(1))], [3, 1])[0].shape
    torch.Size([2, 4, 4])

    """
    if len(outputs) == 1:
        return outputs[0]  # not copied

    def join(tensors):
        if all(tensor.dim() == 0 for tensor in tensors):
            if not tensors[0].is_floating_point():
                return tensors[-1]
            stacked = torch.stack(tensors)
            weights = stacked.new_tensor(rows if sum(rows) else [1] * len(rows))
            return (stacked * weights).sum() / weights.sum()
        # a module's .squeeze() leaves a one-row piece's output 0-d, where the
        # large batch's has rows
        tensors = [tensor.reshape(1) if tensor.dim() == 0 else tensor
                   for tensor in tensors]
        axis = _rows_axis(tensors, rows)
        shapes = {out.shape[:axis] + out.shape[axis + 1:] for out in tensors}
        if len(shapes) > 1:
            raise ValueError(
                "Cannot join the micro-batches of a step into one batch for "
                "the callbacks: their shapes differ beyond the first axis, {}. "
                "Pad every micro-batch to one length (collate_fn), or have no "
                "callback read the training batch.".format(
                    sorted(tuple(out.shape) for out in tensors)))
        return torch.cat(tensors, dim=axis)

    def per_row(lists):  # a collate_fn's list of one item per row
        return isinstance(lists[0], list) and all(
            _is_per_row(each, n) for each, n in zip(lists, rows))

    return _apply(join, outputs, per_row)


def _rows_axis(tensors, rows):
    """Return the axis of ``tensors`` that holds each piece's ``rows``.

    The first, unless it is not the rows and a later one is, in every piece
    (an RNN's state: layers, then rows).
    """
    if all(rows) and any(len(out) != n for out, n in zip(tensors, rows)):
        for axis in range(1, min(out.dim() for out in tensors)):
            if all(out.shape[axis] == n for out, n in zip(tensors, rows)):
                return axis
    return 0


# The pieces of a micro-batch

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


def cost_per_row(batch):
    rows, cost = batch_len(batch), batch_cost(batch)
    return cost / rows if cost and rows else 1.0


def nbytes(data):
    """Return the bytes of the tensors and arrays in ``data`` (a DTensor's shard)."""
    total = 0
    for array in arrays_in(data):
        if hasattr(array, 'to_local'):  # a DTensor
            array = array.to_local()
        total += array.nbytes if isinstance(array, np.ndarray) else (
            array.nelement() * array.element_size())
    return total


def rows_within(cost, per_row, rows):
    """Return the most rows, 1 to ``rows``, whose cost is at most ``cost``."""
    return max(1, min(rows, int(cost / per_row + 1e-9)))


def planned_rows(rows, size):
    """Return the rows of the pieces a plan takes: of ``rows``, at most ``size``.

    ``rows`` itself, or the largest of the sizes 1, 2, 3, 4, 5, 6, 8, 9,
    11, 13, 16, 19, 22, 26, 32, ... (2 ** (j / 4), rounded down: each at
    most 1.19 times the last) that is at most ``size``; at least 1. A grid,
    not the size itself: a measurement's noise moves the size a plan finds,
    but seldom across a step of the grid.

    Examples
    --------
    >>> planned_rows(128, 37), planned_rows(128, 200), planned_rows(1000, 700)
    (32, 128, 608)

    """
    if size >= rows:
        return max(rows, 1)
    return max(_planned_sizes(size))


def planned_above(rows, size):
    """Return the least rows of :func:`planned_rows` above ``size``, or None.

    Examples
    --------
    >>> planned_above(512, 171), planned_above(512, 500)
    (181, 512)

    """
    if size >= rows:
        return None
    return min(rows, next(step for step in _planned_sizes(2 * size + 1)
                          if step > size))


def _planned_sizes(most):
    """Yield the sizes of the grid of :func:`planned_rows`, up to ``most``."""
    exponent = 0
    while int(2 ** (exponent / 4)) <= max(most, 1):
        yield int(2 ** (exponent / 4))
        exponent += 1


def length_or_none(iterable):
    """Return ``len(iterable)``, or None if it has no length it keeps.

    None for a DataLoader over an ``IterableDataset``: its length is torch's
    estimate from the dataset's ``__len__``, and torch (plain skorch too)
    reads the stream to its end, which may yield more batches (workers that
    split it, each with its own short last one, or a ``__len__`` too small).
    Kept for one that drops a short last batch (``drop_last``) without
    workers: the large batch's short last one is dropped.
    """
    data = torch.utils.data
    if isinstance(iterable, data.DataLoader) and isinstance(
            iterable.dataset, data.IterableDataset) and (
                iterable.num_workers or not iterable.drop_last):
        return None
    try:
        return len(iterable)
    except TypeError:
        return None


#: The oldest torch whose FSDP2 :mod:`skorch_gradacc.fully_sharded` uses:
#: ``fully_shard``, and ``set_force_sum_reduction_for_comms`` for sum-only
#: reductions on gloo.
FSDP2_TORCH = (2, 8)


def uncompiled(module):
    """Return the module that ``torch.compile`` wrapped, or ``module``.

    skorch's ``compile=True`` wraps each module and criterion after
    ``initialize_module`` (around DDP's or FSDP2's module); the wrapper
    keeps it as ``_orig_mod``, as skorch reads it.
    """
    return getattr(module, '_orig_mod', module)


def has_fsdp2():
    """Whether this torch has the FSDP2 that ``FullyShardedGradAccMixin`` uses."""
    return torch.torch_version.TorchVersion(torch.__version__) >= FSDP2_TORCH


def is_positive_int(value):
    """Whether ``value`` is an integer of at least 1, and not a bool."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and value >= 1)


def check_positive_int(name, value, others=''):
    """Raise a ValueError unless ``value`` is a positive integer.

    ``others`` names the other values allowed, e.g. ``"None, 'auto' or "``.
    """
    if not is_positive_int(value):
        raise ValueError("{} must be {}a positive integer, got {!r} instead."
                         .format(name, others, value))


def check_bool(name, value):
    """Raise a ValueError unless ``value`` is True or False.

    NumPy's bools count, as a grid search over ``np.array([True, False])``
    gives them.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError("{} must be True or False, got {!r} instead.".format(
            name, value))


def _distributed():
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def n_ranks():
    """Return the number of ranks of the default process group; 1 without one."""
    return torch.distributed.get_world_size() if _distributed() else 1


def this_rank():
    """Return this process's rank in the default process group; 0 without one."""
    return torch.distributed.get_rank() if _distributed() else 0


_INTERNAL = tuple(str(Path(module.__file__).parent) + os.sep
                  for module in (sys.modules['skorch'], torch, sklearn, joblib,
                                 sys.modules[__name__.rpartition('.')[0]]))


def user_stacklevel():
    """Return the ``stacklevel`` of a warning that points at the user's call.

    That is the first frame, from the function that warns outwards, whose
    code is not this package's, skorch's, torch's (an optimizer's step),
    scikit-learn's or joblib's (a search, a cross-validation).
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(
            _INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
