"""What a micro-batch's loss averages over, and a check that it does.

:meth:`~skorch_gradacc.GradAccMixin.count_loss_items` weights each
micro-batch by the items its loss averages over. :func:`count_items` knows
what torch's criteria divide by with ``reduction='mean'``:

* :class:`torch.nn.CrossEntropyLoss` and :class:`torch.nn.NLLLoss` with
  class-index targets: the targets that are not ``ignore_index``, each
  weighted by its class ``weight`` if one is set (with or without
  ``label_smoothing``). With probability targets (floating point, shaped
  like the input), CrossEntropyLoss divides by the targets' elements over
  the classes, whatever the weight.
* Element-wise losses (:class:`torch.nn.MSELoss`, ``L1Loss``,
  ``BCEWithLogitsLoss``, ``BCELoss``, ``HuberLoss``, ``SmoothL1Loss``,
  ``SoftMarginLoss``, ``PoissonNLLLoss``, ``KLDivLoss`` with ``'mean'``):
  the target's elements, read from its shape.
* Any other criterion, ``KLDivLoss`` with ``'batchmean'``, a target that
  is not a tensor, or several criteria that would count differently: the
  rows of the micro-batch. Criteria that all sum (``reduction='sum'``):
  None, nothing is rescaled.

Counts are Python numbers, or tensors on the targets' (or the class
weight's) device, never read on the host. :func:`check_loss_is_mean`
verifies once per fit that the loss is a mean over what is counted.
"""

import math
import random
import warnings

import numpy as np
import torch
from skorch.dataset import unpack_data

from skorch_gradacc.batching import batch_len, split_batch
from skorch_gradacc.item_counts import ItemCounts

__all__ = ['LossItemsWarning', 'check_loss_is_mean', 'count_items']

CLASS_TARGET_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
ELEMENTWISE_LOSSES = (
    torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.BCELoss,
    torch.nn.BCEWithLogitsLoss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss,
    torch.nn.SoftMarginLoss, torch.nn.PoissonNLLLoss, torch.nn.KLDivLoss)


class LossItemsWarning(UserWarning):
    """The loss is not a mean over what ``count_loss_items`` counts."""


def _rule(criterion):
    """How ``criterion`` averages: a hashable rule, or 'rows'."""
    reduction = getattr(criterion, 'reduction', None)
    if reduction == 'sum':
        return 'sum'
    if reduction != 'mean':
        return 'rows'
    if isinstance(criterion, CLASS_TARGET_LOSSES):
        weight = getattr(criterion, 'weight', None)
        # the weight tensor itself: two criteria with equal weights in
        # different tensors count rows
        return ('classes', criterion.ignore_index,
                None if weight is None else id(weight))
    if isinstance(criterion, ELEMENTWISE_LOSSES):
        return 'elements'
    return 'rows'


def count_items(criteria, batch):
    """Return what the criteria's mean loss of ``batch`` averages over.

    Parameters
    ----------
    criteria : list
      The net's criteria (``net.criterion_`` and any others it registered).

    batch
      A micro-batch ``(X, y)``; the targets ``y`` are what the criteria are
      given by skorch's ``get_loss``.

    Returns
    -------
    count : int, tensor or None
      See the module's docstring; None if every criterion sums.

    Examples
    --------
    >>> import torch
    >>> y = torch.tensor([[1, 2, -100], [0, -100, -100]])
    >>> X = torch.zeros(2, 3)  # two rows of three token ids
    >>> count_items([torch.nn.CrossEntropyLoss()], (X, y))
    tensor(3)

    """
    rules = [_rule(criterion) for criterion in criteria]
    if rules and all(rule == 'sum' for rule in rules):
        return None
    rows = batch_len(batch)
    if not rules or any(rule != rules[0] for rule in rules[1:]):
        return rows
    rule = rules[0]
    y = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
    if rule == 'rows' or not isinstance(y, torch.Tensor):
        return rows
    if rule == 'elements':
        return y.numel()
    _, ignore_index, _ = rule
    weight = criteria[0].weight
    if y.is_floating_point():  # probabilities, shaped like the input
        return y.numel() // y.shape[1] if y.ndim > 1 else 1
    labeled = y != ignore_index
    if weight is None:
        return labeled.sum()
    labeled = labeled.to(weight.device, non_blocking=True)
    classes = y.to(weight.device, non_blocking=True).masked_fill(~labeled, 0)
    dtype = torch.float32 if weight.device.type == 'mps' else torch.float64
    return (weight.to(dtype)[classes] * labeled).sum()


# The check

def check_loss_is_mean(net, batch, **fit_params):
    """Warn if ``net``'s loss of ``batch`` is not a mean over its counted items.

    The loss of the micro-batch is compared with the losses of its two
    halves, weighted by ``net.count_loss_items`` (or summed, if that is
    None), in eval mode and without gradient. Nothing of the net's state
    changes: the modules' training modes and buffers and the random number
    generators' states are restored, and the warnings of these passes (say,
    a criterion's broadcasting warning) are not shown again.

    Returns
    -------
    checked : bool or None
      True once decided; also, unchecked, in multi-process training and for
      a batch that is not ``(X, y)``, which skorch's ``get_loss`` does not
      see. False if its three forward passes cannot decide: no items, or a
      loss that is not finite. None, with no forward pass, if ``batch`` has
      fewer than two rows.

    """
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return True  # each rank's forward may take part in collectives
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return True  # trained by the user's own train_step_single
    rows = batch_len(batch)
    if rows < 2:
        return None
    parts = [batch] + split_batch(batch, (rows + 1) // 2)
    valid = ItemCounts(name='count_loss_items(batch)').check  # as training
    # the user sees the warnings of the training passes, not these
    with _unchanged(net), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        losses, counts = [], []
        for part in parts:
            Xi, yi = unpack_data(part)
            y_pred = net.infer(Xi, **fit_params)
            loss = net.get_loss(y_pred, yi, X=Xi, training=True)
            losses.append(float(loss))
            count = valid(net.count_loss_items(part))
            counts.append(None if count is None else float(count))
    whole, first, second = losses
    if counts[0] is None:
        expected = first + second
    else:
        total = counts[1] + counts[2]
        if not total:
            return False
        expected = sum(count * loss for count, loss in zip(counts[1:], losses[1:])
                       if count) / total
    scale = max(abs(whole), abs(expected))
    error = abs(whole - expected) / scale if scale else 0.0
    dtype = loss.dtype if loss.is_floating_point() else torch.float32
    if not math.isfinite(error):
        return False
    if error <= max(1e-10, 1e3 * torch.finfo(dtype).eps):
        return True
    warnings.warn(
        "The loss is not a mean over the items that count_loss_items counts: "
        "on a micro-batch of {} rows, in eval mode, it is {:.6g}, but the "
        "count-weighted mean of its two halves' losses is {:.6g} (relative "
        "difference {:.2g}). Accumulation then weights the micro-batches "
        "unlike the large batch, and training differs from plain skorch at "
        "batch_size * acc_steps. If get_loss adds a sum over the rows (a "
        "penalty such as lambda * z.abs().sum()), make it a mean over the "
        "same items as the rest of the loss; if the criterion averages over "
        "something else, override count_loss_items to count it (None for a "
        "sum). Set check_loss=False to skip this check.".format(
            rows, whole, expected, error), LossItemsWarning, stacklevel=2)
    return True


class _unchanged:
    """Eval mode inside; modes, buffers and RNG states as before after."""

    def __init__(self, net):
        self.net = net

    def _modules(self):
        net = self.net
        for name in net._modules + net._criteria:
            module = getattr(net, name + '_', None)
            if isinstance(module, torch.nn.Module):
                yield module

    def __enter__(self):
        self.modes = [(sub, sub.training) for module in self._modules()
                      for sub in module.modules()]
        self.buffers = [(buffer, buffer.detach().clone())
                        for module in self._modules()
                        for buffer in module.buffers()]
        self.rng = (torch.get_rng_state(), random.getstate(),
                    np.random.get_state())
        self.cuda_rng = (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_initialized() else None)
        self.net._set_training(False)
        return self

    def __exit__(self, *exc_info):
        for sub, training in self.modes:
            sub.training = training
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False
