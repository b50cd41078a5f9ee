"""What a micro-batch's loss averages over, and the weighting by it.

:func:`count_items` counts what torch's criteria divide by,
:class:`ItemCounts` weights a group's micro-batches by their counts (for
:class:`~skorch_gradacc.GradAccMixin` and :class:`~skorch_gradacc.AccumGrad`
alike), and :func:`check_loss_is_mean` checks, once in a fit from scratch
that trains in groups, that the loss is a mean over what is counted. Counts
are Python numbers, or tensors that are never read on the host, so that
counting never waits for the device.
"""

import contextlib
import math
import numbers
import random
import warnings

import numpy as np
import torch

from skorch_gradacc.batching import (
    arrays_in,
    batch_len,
    concat_outputs,
    n_ranks,
    split_batch,
    take_rows,
    uncompiled,
    user_stacklevel,
)

__all__ = ['BatchNormWarning', 'LossItemsWarning', 'count_items']

CLASS_TARGET_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
ELEMENTWISE_LOSSES = (
    torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.BCELoss,
    torch.nn.BCEWithLogitsLoss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss,
    torch.nn.SoftMarginLoss, torch.nn.PoissonNLLLoss, torch.nn.KLDivLoss)


class LossItemsWarning(UserWarning):
    """The loss is not a mean over what ``count_loss_items`` counts."""


class BatchNormWarning(UserWarning):
    """A module normalizes by the statistics of pieces smaller than the batch.

    Silence it with ``warnings.filterwarnings('ignore',
    category=BatchNormWarning)``.
    """


# the layers that normalize by the statistics of the batch they see
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d,
               torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def warn_of_batch_norm(net):
    """Warn if ``net`` trains a BatchNorm on pieces smaller than its batch.

    In training mode, as the net sets it (a module may keep its BatchNorm
    in eval mode); with ``acc_steps`` above 1 or ``micro_batch_size``.
    """
    if net.get_acc_steps() == 1 and net.micro_batch_size is None:
        return
    net._set_training(True)
    norms = [type(layer).__name__ for module in net_modules(net)
             for layer in module.modules()
             if isinstance(layer, BATCH_NORMS) and layer.training]
    if norms:
        warnings.warn(
            "{} trains {} on pieces smaller than its batch: their statistics "
            "differ from the large batch's, and so does training (docs: FAQ, "
            "BatchNorm). To silence it, filter BatchNormWarning.".format(
                type(net).__name__, norms[0]), BatchNormWarning,
            stacklevel=user_stacklevel())


def _rule(criterion):
    """How ``criterion`` averages: a hashable rule, or 'rows'."""
    criterion = uncompiled(criterion)
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

    ``CrossEntropyLoss`` and ``NLLLoss``: the targets that are not
    ``ignore_index``, weighted by the class ``weight`` if set (probability
    targets: their rows). Element-wise losses (``MSELoss``,
    ``BCEWithLogitsLoss``, ...): the target's elements. Any other
    criterion, or criteria that count differently: the rows. None if every
    criterion sums (``reduction='sum'``).

    Parameters
    ----------
    criteria : list
      The net's criteria (``net.criterion_`` and any others it registered).

    batch
      A micro-batch ``(X, y)``, or ``(X, y, ...)`` (a sample weight, say).

    Returns
    -------
    count : int, tensor or None
      A tensor stays on the targets' (or the class weight's) device.

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
    y = batch[1] if isinstance(batch, (tuple, list)) and len(batch) >= 2 else None
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


# Weighting a group by its counts


class ItemCounts:
    """The item counts of one group of micro-batches and the unit of ``.grad``.

    ``.grad`` holds ``sum_j (c_j / u) * g_j``: ``g_j`` is the gradient of
    micro-batch ``j``'s mean loss, ``c_j`` its count and ``u`` the unit.
    Without ``rescale`` (the net), ``u`` is ``count_unit`` or the first positive
    count, and :attr:`weight` ``c_j / u`` multiplies the micro-batch's loss
    for its backward. With ``rescale`` (:class:`~skorch_gradacc.AccumGrad`),
    ``u`` is the last positive count and :meth:`add` rescales ``.grad`` when
    it changes. :meth:`mean_scale` ``u / C`` then makes ``.grad`` the
    gradient of the mean over the group's ``C`` items. Tensor counts on a
    device (any but :attr:`host_devices`) are never read on the host.

    Parameters
    ----------
    rescale : callable or None (default=None)
      ``rescale(scale)`` multiplies all gradients in place.

    count_unit : float or None (default=None)
      A fixed unit, the same on every rank (FSDP2); None: the first
      positive count.

    share : callable or None (default=None)
      ``share(count)``: the largest ``count`` over ranks, for a unit that
      is the same on every rank (FSDP2 under fp16). Every rank adds its
      counts in step until one has items.

    name : str (default='count')
      What a bad count is called in the error message.

    Attributes
    ----------
    summed : bool or None
      Whether the losses are sums (counts of None).

    total : float or tensor
      The group's item count so far.

    count, weight : float, tensor or None
      The count and weight of the micro-batch last added.

    """

    host_devices = frozenset({'cpu'})

    def __init__(self, rescale=None, count_unit=None, name='count', share=None):
        self.rescale = rescale
        self.share = share
        self.name = name
        self.summed = None
        self.count_unit = count_unit
        self.total = 0.0
        self.weight = None
        self.count = None
        self._loss_sum = None

    def check(self, count, summed_ok=True):
        """Return ``count``, read on the host if it is on the CPU, or raise.

        A count is a number of items (finite, 0 or more), a one-element
        tensor of numbers, or None (a summed loss) if ``summed_ok``.
        """
        if isinstance(count, torch.Tensor):
            if (count.numel() != 1 or count.dtype == torch.bool
                    or count.is_complex()):
                raise ValueError(
                    "{} must be a number or a one-element tensor of numbers, "
                    "got a tensor of shape {} and dtype {} instead.".format(
                        self.name, tuple(count.shape), count.dtype))
            if count.device.type not in self.host_devices:
                return count  # never read: no waiting for the device
            count = count.item()
        if (count is not None or not summed_ok) and (
                not isinstance(count, numbers.Real) or isinstance(count, bool)
                or not math.isfinite(count) or count < 0):
            raise ValueError(
                "{} must be a number of items, 0 or more, got {!r} instead."
                .format(self.name, count))
        return count

    def add(self, count, skippable=False):
        """Count the coming micro-batch; call it before its backward.

        ``count`` is what its loss averages over, None for a summed loss.
        Returns False if the backward can be left out: only if
        ``skippable`` and the count is the number 0 after items were seen.
        """
        count = self.check(count)
        summed = count is None
        if self.summed is None:
            self.summed = summed
        elif self.summed != summed:
            raise ValueError(
                "count_loss_items returned None for some micro-batches but "
                "not for others; got {!r}.".format(count))
        if summed:
            self.weight = None
            return True
        if self.share is not None and self.count_unit is None:
            shared = self.share(count)  # on every rank, until one has items
            self.count_unit = shared if shared > 0 else None
        if isinstance(count, torch.Tensor) or isinstance(
                self.total, torch.Tensor):
            self._add_tensor(count)
            return True
        count = self.count = float(count)
        if not count:
            self.weight = 0.0
            return not (skippable and self.total)  # after items were seen
        if self.rescale is not None and self.count_unit not in (None, count):
            self.rescale(self.count_unit / count)
        if self.count_unit is None or self.rescale is not None:
            self.count_unit = count
        self.weight = count / self.count_unit
        self.total += count
        return True

    def _add_tensor(self, count):
        if not isinstance(self.total, torch.Tensor):  # the first tensor
            device = count.device
            dtype = torch.float32 if device.type == 'mps' else torch.float64
            # new_full and full fill on the device: no copy from the host
            self.total = torch.full((), self.total, dtype=dtype, device=device)
        if isinstance(count, torch.Tensor):
            count = count.detach().reshape(()).to(
                device=self.total.device, dtype=self.total.dtype)
        else:
            count = self.total.new_full((), float(count))
        positive = count > 0
        if self.count_unit is None:
            self.count_unit = torch.where(positive, count, 1.0)
        elif self.rescale is not None:
            # unit / 0 is inf, never selected
            self.rescale(torch.where(positive, self.count_unit / count, 1.0))
            self.count_unit = torch.where(positive, count, self.count_unit)
        self.weight = count / self.count_unit  # 0 without items: the unit is > 0
        self.total = self.total + count
        self.count = count

    def add_loss(self, loss):
        """Add the loss of the micro-batch last counted, weighted by its count."""
        count = self.count
        if self.summed:
            term = loss
        elif isinstance(count, torch.Tensor):
            count = count.to(device=loss.device, dtype=loss.dtype)
            # an item-less micro-batch's mean loss is NaN (0 / 0)
            term = torch.where(count > 0, count * loss, 0.0)
        elif count:
            term = count * loss
        else:
            return
        # one running sum, not a tensor per piece: a group of many pieces
        # would keep each one's (and the heap pages around it) to its end
        self._loss_sum = term if self._loss_sum is None else self._loss_sum + term

    def loss_sum(self):
        """Return the group's losses summed, each weighted by its count.

        A zero tensor if no micro-batch added a loss (a rank without items).
        """
        return torch.zeros(()) if self._loss_sum is None else self._loss_sum

    def loss(self, loss_sum=None, total=None):
        """Return the group's loss: the mean over its items, or the sum.

        NaN if the group has no item (the mean of nothing). ``loss_sum`` and
        ``total`` default to this rank's; an engine passes those of all ranks.
        """
        summed = self.loss_sum() if loss_sum is None else loss_sum
        total = self.total if total is None else total
        if self.summed:
            return summed
        if isinstance(total, torch.Tensor):
            return summed / total.to(device=summed.device, dtype=summed.dtype)
        return summed / total if total else torch.tensor(float('nan'))

    def mean_scale(self, total=None, count_unit=None):
        """Return ``u / C``, what makes ``.grad`` the mean's gradient.

        1 for summed losses and for a group without items. ``total`` and
        ``count_unit`` default to this rank's.
        """
        total = self.total if total is None else total
        count_unit = self.count_unit if count_unit is None else count_unit
        if self.summed or count_unit is None:
            return 1.0
        if isinstance(total, torch.Tensor):
            return torch.where(total > 0, count_unit / total, 1.0)
        return count_unit / total if total else 1.0

    def normalize(self):
        """Multiply ``.grad`` by :meth:`mean_scale`, after the last backward."""
        self.rescale(self.mean_scale())


def weighted_loss(loss, y_pred, weight, scaler):
    """Return ``loss``, with the gradient of ``loss`` times ``weight``.

    And times the scale of ``scaler``, a GradScaler or None. ``weight`` is
    a number, a tensor or None (not weighted); 0 gives a zero gradient
    through the outputs ``y_pred``, never through the loss, which may be
    NaN.
    """
    # in float32 at least: a float16 loss times its weight and scale may
    # overflow, and its value must stay the loss's
    base = loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
    if isinstance(weight, torch.Tensor):
        weighted = base * weight.to(base)
    elif weight == 0:
        weighted = sum(0 * out.sum() for out in arrays_in(y_pred)
                       if isinstance(out, torch.Tensor))
    else:
        weighted = base if weight in (None, 1) else base * weight
    if scaler is not None:
        weighted = scaler.scale(weighted)
    if weighted is loss:
        return loss  # nothing to weight or scale
    # the value of the loss, the gradient of the weighted one
    return loss.detach() + (weighted - weighted.detach()).to(loss.dtype)


@contextlib.contextmanager
def get_loss_weighted(net, weight, scaler):
    """Weigh the loss of ``net.get_loss`` in training, inside the block.

    ``get_loss`` is replaced on the instance by one that returns
    :func:`weighted_loss` of skorch's (or the user's) with the user's
    arguments, so that any ``train_step_single`` that calls it weighs its
    loss (skorch has no loss hook). Yields the list of its training calls.
    """
    get_loss, calls = net.get_loss, []

    def get_weighted_loss(y_pred, y_true, X=None, training=False, **kwargs):
        loss = get_loss(y_pred, y_true, X=X, training=training, **kwargs)
        if training:
            calls.append(True)
            loss = weighted_loss(loss, y_pred, weight, scaler)
        return loss

    own = vars(net).get('get_loss')  # e.g. a test's mock
    net.get_loss = get_weighted_loss
    try:
        yield calls
    finally:
        del net.get_loss
        if own is not None:
            net.get_loss = own


def scale_gradients(grads, scale):
    """Multiply ``grads`` in place by ``scale``, a number or a tensor.

    A tensor is moved to each gradient's device, never read on the host.
    """
    is_tensor = isinstance(scale, torch.Tensor)
    if not is_tensor and scale == 1:
        return
    by_kind = {}
    for grad in grads:
        # FSDP2's sharded gradients (DTensors) apart from plain ones (a
        # criterion's): one _foreach call takes one kind
        by_kind.setdefault((grad.device, grad.dtype, type(grad)), []).append(grad)
    for (device, dtype, _), same in by_kind.items():
        torch._foreach_mul_(same, scale.to(device=device, dtype=dtype)
                            if is_tensor else scale)


def weighted_mean(pairs):
    """Return the count-weighted mean of ``(count, value)`` pairs.

    The sum if the counts are None (summed losses); pairs with a count of
    0 (the mean of nothing) are left out; None if no count is positive.
    """
    pairs = list(pairs)
    if pairs and pairs[0][0] is None:
        return sum(value for _, value in pairs)
    counted = [(count, value) for count, value in pairs if count]
    if not counted:
        return None
    return (sum(count * value for count, value in counted)
            / sum(count for count, _ in counted))


def validate_in_pieces(net, pieces, validation_step, **fit_params):
    """Return the validation step of a batch in ``pieces``.

    ``validation_step``: skorch's, on a piece. The loss is the mean over
    the batch's items, weighted by ``net.count_loss_items`` as in
    training, and ``y_pred`` the pieces' outputs joined.
    """
    steps, counts = [], ItemCounts(name='count_loss_items(batch)')
    for piece in pieces:
        counts.add(net.count_loss_items(piece))
        steps.append(validation_step(piece, **fit_params))
        counts.add_loss(steps[-1]['loss'])
    return {'loss': counts.loss(),
            'y_pred': concat_outputs([step['y_pred'] for step in steps],
                                     [batch_len(piece) for piece in pieces])}


def merge_piece_records(row, records):
    """Give a history row the values the large batch would have recorded.

    ``records``: ``(count, values)`` of each piece, the values it recorded
    in ``row``. A float recorded by several pieces (a loss term, say) is
    combined as the loss is, by :func:`weighted_mean`; other values keep
    the last piece's.
    """
    if row is None or len(records) < 2:
        return
    for key in {key for _, values in records for key in values}:
        pairs = [(count, values[key]) for count, values in records
                 if key in values]
        if len(pairs) < 2 or not all(_is_float(value) for _, value in pairs):
            continue
        merged = weighted_mean(pairs)
        if merged is not None:  # else every piece was item-less
            row[key] = merged


class StepExtras:
    """What ``train_step_single`` returns besides the loss and ``y_pred``.

    Over a group's pieces, as :func:`merge_piece_records` merges recorded
    values: a float that several pieces return, as the loss is; any other
    value, the last piece's. Tensors are detached, and only the last
    piece's kept (a piece's graph is freed with it).
    """

    def __init__(self):
        self.last, self.floats = {}, []

    def add(self, count, step):
        """Note the step of a piece of ``count`` items."""
        self.last = {key: value.detach() if isinstance(value, torch.Tensor)
                     else value for key, value in step.items()
                     if key not in ('loss', 'y_pred')}
        self.floats.append((count, {key: value for key, value in self.last.items()
                                    if _is_float(value)}))

    def merged(self):
        """Return the group's values, merged."""
        merge_piece_records(self.last, self.floats)
        return self.last


def _is_float(value):
    """Whether ``value`` is a float scalar: Python, numpy, or a 0-d tensor."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and value.dtype.is_floating_point
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and np.issubdtype(value.dtype, np.floating)
    return isinstance(value, (float, np.floating))


# The check that the loss is a mean over what is counted

# the micro-batches the loss check tries: one may happen to agree (its
# pieces' rows in proportion to what a mean over other items counts), or be
# undecided (no items, a loss that is not finite)
LOSS_CHECK_TRIES = 3


def check_loss_while_pending(net, piece, **fit_params):
    """Check the loss on ``piece`` while ``net.loss_check_pending_``.

    Each try leaves one fewer (:data:`LOSS_CHECK_TRIES` in a fit); a
    warning, or a loss that cannot be checked, ends the check.
    """
    if getattr(net, 'loss_check_pending_', 0):
        checked = check_loss_is_mean(net, piece, **fit_params)
        if checked is not None:  # a try: four forward passes
            net.loss_check_pending_ = net.loss_check_pending_ - 1 if checked else 0


def check_loss_is_mean(net, batch, **fit_params):
    """Warn if ``net``'s loss of ``batch`` is not a mean over its counted items.

    Compares the loss of ``batch`` with the count-weighted mean of its
    pieces' losses (its first row, and the halves of the rest: pieces of
    unequal rows, whose counts seldom all stand in the same proportion to
    their rows), in eval mode, without gradient and without side effects
    (see :func:`snapshot_buffers`). Returns whether the check goes on:
    False after a warning, with several ranks and for batches that are
    not ``(X, y, ...)`` (unchecked), and with a warning where the passes raise
    (a ``train_step_single`` of the user's that prepares ``X``, a module
    whose output in training differs): the training pass shows the user's
    own errors. True where the loss agrees, or its passes cannot decide (no
    items, a loss that is not finite); None, without a pass, for fewer than
    two rows.
    """
    if n_ranks() > 1:
        return False  # each rank's forward may take part in collectives
    if not (isinstance(batch, (tuple, list)) and len(batch) >= 2):
        return False  # trained by the user's own train_step_single
    rows = batch_len(batch)
    if rows < 2:
        return None
    rest = take_rows(batch, slice(1, None))
    pieces = [batch, take_rows(batch, slice(1))] + split_batch(rest, rows // 2)
    valid = ItemCounts(name='count_loss_items(batch)').check  # as training
    counts = [valid(net.count_loss_items(piece)) for piece in pieces]
    counts = [None if count is None else float(count) for count in counts]
    try:
        # the user sees the warnings of the training passes, not these
        with _without_side_effects(net), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter('ignore')
            losses = []
            for piece in pieces:
                Xi, yi = piece[:2]  # a sample weight after them: the user's
                y_pred = net.infer(Xi, **fit_params)
                loss = net.get_loss(y_pred, yi, X=Xi, training=True)
                losses.append(float(loss))
    except Exception as error:  # noqa: BLE001 (a step or module of its own)
        from skorch_gradacc.memory import is_out_of_memory  # which imports this

        if is_out_of_memory(error):
            raise  # the training pass's to back off from
        warnings.warn(
            "check_loss could not compute the loss as net.infer(X), then "
            "get_loss(y_pred, y, training=True) in eval mode: {}: {}. The loss "
            "is not checked to be a mean; set check_loss=False where "
            "train_step_single or the module's training output differs on "
            "purpose.".format(type(error).__name__, error), LossItemsWarning,
            stacklevel=user_stacklevel())
        return False
    whole = losses[0]
    expected = weighted_mean(zip(counts[1:], losses[1:]))
    if expected is None:
        return True
    scale = max(abs(whole), abs(expected))
    error = abs(whole - expected) / scale if scale else 0.0
    dtype = loss.dtype if loss.is_floating_point() else torch.float32
    if not math.isfinite(error) or error <= max(1e-10, 1e3 * torch.finfo(dtype).eps):
        return True
    warnings.warn(
        "The loss is not a mean over what count_loss_items counts: {:.6g} on "
        "{} rows, {:.6g} from its pieces (relative difference {:.2g}). Make "
        "it one, override count_loss_items (None for a sum), or set "
        "check_loss=False.".format(whole, rows, expected, error),
        LossItemsWarning, stacklevel=user_stacklevel())
    return False


def net_modules(net):
    """Yield the net's initialized modules and criteria."""
    for name in net._modules + net._criteria:
        module = getattr(net, name + '_', None)
        if isinstance(module, torch.nn.Module):
            yield module


def net_optimizers(net):
    """Yield the net's initialized optimizers, unwrapped.

    A wrapper such as Accelerate's ``AcceleratedOptimizer`` holds the
    :class:`torch.optim.Optimizer` in its ``optimizer`` attribute.
    """
    for name in net._optimizers:
        optimizer = getattr(net, name + '_', None)
        while isinstance(getattr(optimizer, 'optimizer', None),
                         torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        if optimizer is not None:
            yield optimizer


def reevaluates_group(net):
    """Whether a step may evaluate its group more than once.

    skorch passes the closure to each optimizer's ``step``: several
    optimizers, LBFGS or a step that is not ``torch.optim``'s (e.g.
    sharpness-aware) may call it again.
    """
    if len(net._optimizers) > 1:
        return True
    for optimizer in net_optimizers(net):
        if isinstance(optimizer, torch.optim.LBFGS):
            return True
        step = getattr(type(optimizer), 'step', None)
        if not getattr(step, '__module__', '').startswith('torch.optim'):
            return True
    return False


def snapshot_buffers(net):
    """Return copies of the buffers of ``net``'s modules, for :func:`restore_buffers`.

    E.g. BatchNorm's running statistics, which a forward pass in training
    mode changes.
    """
    return [(buffer, buffer.detach().clone())
            for module in net_modules(net) for buffer in module.buffers()]


def restore_buffers(snapshot):
    """Copy the buffers of a :func:`snapshot_buffers` back in place."""
    with torch.no_grad():
        for buffer, saved in snapshot:
            buffer.copy_(saved)


class _without_side_effects:
    """Eval mode inside; modes, buffers, RNG states and the row as before after.

    The row: the history's training row of the step, where ``get_loss``
    may record (skorch's ``record_batch``).
    """

    def __init__(self, net):
        self.net = net

    def __enter__(self):
        self.modes = [(sub, sub.training) for module in net_modules(self.net)
                      for sub in module.modules()]
        self.buffers = snapshot_buffers(self.net)
        self.rng = (torch.get_rng_state(), random.getstate(),
                    np.random.get_state())
        self.cuda_rng = (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_initialized() else None)
        self.row = self.net._current_batch_row()
        self.recorded = None if self.row is None else dict(self.row)
        self.net._set_training(False)
        return self

    def __exit__(self, *exc_info):
        for sub, training in self.modes:
            sub.training = training
        restore_buffers(self.buffers)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.row is not None:
            self.row.clear()
            self.row.update(self.recorded)
        return False
