"""Weighting the micro-batches of a group by the items their losses average.

Used by :class:`~skorch_gradacc.GradAccMixin` and by
:class:`~skorch_gradacc.AccumGrad`, so that both check and weight counts
the same way: :class:`ItemCounts` keeps a group's counts and gives each
micro-batch's weight (the net weights its loss's gradient by it) or rescales
``.grad`` in place (:class:`~skorch_gradacc.AccumGrad`, which never sees
the loss), and :func:`scale_gradients` multiplies gradients by a number or
by a tensor.

Counts are Python numbers or tensors. A tensor count on an accelerator,
e.g. a token count ``(y != -100).sum()`` on the GPU, is never read on the
host: all the bookkeeping is done with tensor operations on its device, so
that the host never waits for the device because of a count. A tensor on
the CPU is read, which costs nothing of the kind.
"""

import math
import numbers

import torch

__all__ = ['ItemCounts', 'scale_gradients']


class ItemCounts:
    """The item counts of one group of micro-batches and the unit of ``.grad``.

    ``.grad`` holds ``sum_j (w_j / u) * g_j``: ``g_j`` is the gradient of
    micro-batch ``j``'s mean loss, ``w_j`` its count ``c_j`` and ``u`` the
    unit. A micro-batch with a count of 0 has no item: it adds nothing to
    the large batch's mean, so its gradient must be zero, or its backward
    skipped (see :meth:`add`). :meth:`factor` is ``u / C``, ``C`` the
    group's total: what makes ``.grad`` the gradient of the mean.

    Without ``rescale`` (the net), the unit is fixed: ``unit``, or the first
    positive count, and :attr:`weight` is ``c_j / u``, what the micro-batch's
    loss is multiplied by for its backward. With ``rescale``
    (:class:`~skorch_gradacc.AccumGrad`), the unit is the last positive
    count, and :meth:`add` rescales ``.grad`` in place when it changes.

    * Python numbers are compared on the host: equal counts cost nothing
      until the end.
    * Tensor counts on a device (any but those in :attr:`host_devices`)
      are never read on the host: weights, factors, the unit and the total
      are tensors on the count's device, in float64 (float32 on MPS). A
      tensor count of 0 cannot be detected without a device
      synchronization, so its micro-batch's backward always runs.
    * Tensors on the CPU are read with ``item()``, which does not wait for
      any device, and counted as Python numbers.

    Parameters
    ----------
    rescale : callable or None (default=None)
      ``rescale(factor)`` multiplies all gradients in place by a number or
      a one-element tensor.

    unit : float or None (default=None)
      A fixed unit, the same on every rank (FSDP2, which cannot rescale
      before its reduce-scatter); None: the first positive count.

    share : callable or None (default=None)
      ``share(count)`` returns the largest of ``count`` over ranks; given,
      the unit is the first positive one, the same on every rank (FSDP2
      under fp16, where a unit of 1 would overflow float16 gradients).
      Every rank must add its counts in step until then.

    name : str (default='count')
      What a bad count is called in the error message.

    Attributes
    ----------
    summed : bool or None
      Whether the losses are sums (counts of None), once a count was added.

    unit : float, tensor or None
      The count that ``.grad`` is in units of; None until an item is seen.

    total : float or tensor
      The group's item count so far.

    count : float, tensor or None
      The count of the micro-batch last added (None: a summed loss).

    weight : float, tensor or None
      The weight of the micro-batch last added (None: a summed loss).

    host_devices : frozenset of str
      The device types whose tensor counts are read on the host (class
      attribute).

    """

    host_devices = frozenset({'cpu'})

    def __init__(self, rescale=None, unit=None, name='count', share=None):
        self.rescale = rescale
        self.share = share
        self.name = name
        self.summed = None
        self.unit = unit
        self.total = 0.0
        self.weight = None
        self.count = None
        self._losses = []

    def check(self, count, summed_ok=True):
        """Return ``count``, read on the host if it is on the CPU, or raise.

        A ValueError names :attr:`name` and the value of a count that is
        not a number of items (0 or more, finite), a one-element tensor of
        numbers, or None (if ``summed_ok``).
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

        Parameters
        ----------
        count : int, float, one-element tensor or None
          The number of items that the micro-batch's loss averages over;
          None if the loss is a sum, in which case nothing is weighted.

        skippable : bool (default=False)
          Whether the caller can skip the micro-batch's backward.

        Returns
        -------
        needs_backward : bool
          False only if ``skippable`` and the count is the Python number 0
          after items were seen: the micro-batch adds nothing.

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
        if self.share is not None and self.unit is None:
            shared = self.share(count)  # on every rank, until one has items
            self.unit = shared if shared > 0 else None
        if isinstance(count, torch.Tensor) or isinstance(
                self.total, torch.Tensor):
            self._add_tensor(count)
            return True
        count = self.count = float(count)
        if not count:
            self.weight = 0.0
            return not (skippable and self.total)  # after items were seen
        if self.rescale is not None and self.unit not in (None, count):
            self.rescale(self.unit / count)
        if self.unit is None or self.rescale is not None:
            self.unit = count
        self.weight = count / self.unit
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
        if self.unit is None:
            self.unit = torch.where(positive, count, 1.0)
        elif self.rescale is not None:
            # unit / 0 is inf, never selected
            self.rescale(torch.where(positive, self.unit / count, 1.0))
            self.unit = torch.where(positive, count, self.unit)
        self.weight = count / self.unit  # 0 without items: the unit is > 0
        self.total = self.total + count
        self.count = count

    def add_loss(self, loss):
        """Add the loss of the micro-batch last counted, weighted by its count."""
        count = self.count
        if self.summed:
            self._losses.append(loss)
        elif isinstance(count, torch.Tensor):
            count = count.to(device=loss.device, dtype=loss.dtype)
            # an item-less micro-batch's mean loss is NaN (0 / 0)
            self._losses.append(torch.where(count > 0, count * loss, 0.0))
        elif count:
            self._losses.append(count * loss)

    def loss_sum(self):
        """Return the group's losses summed, each weighted by its count.

        A zero tensor if no micro-batch added a loss, e.g. in data-parallel
        training on a rank whose micro-batches have no item.
        """
        if not self._losses:
            return torch.zeros(())
        return torch.stack(self._losses).sum()

    def loss(self):
        """Return the group's loss: the mean over its items, or the sum.

        NaN if the group has no item (the mean of nothing).
        """
        summed = self.loss_sum()
        if self.summed:
            return summed
        if isinstance(self.total, torch.Tensor):
            return summed / self.total.to(device=summed.device,
                                          dtype=summed.dtype)
        return summed / self.total if self.total else torch.tensor(float('nan'))

    def factor(self):
        """Return ``u / C``, what makes ``.grad`` the mean's gradient.

        1 for summed losses and for a group without items, whose gradient
        is left as its losses gave it. A tensor if the total is one.
        """
        if self.summed or self.unit is None:
            return 1.0
        if isinstance(self.total, torch.Tensor):
            return torch.where(self.total > 0, self.unit / self.total, 1.0)
        return self.unit / self.total if self.total else 1.0

    def normalize(self):
        """Multiply ``.grad`` by :meth:`factor`; once, after the last backward."""
        self.rescale(self.factor())


def scale_gradients(grads, factor):
    """Multiply ``grads`` in place by ``factor``, a number or a tensor.

    Nothing is done for a factor of the number 1.

    A tensor factor is moved to each gradient's device and dtype, where it
    is read by the kernel, never on the host: one
    :func:`torch._foreach_mul_` per device and dtype.
    """
    if not isinstance(factor, torch.Tensor):
        if grads and factor != 1:
            torch._foreach_mul_(grads, factor)
        return
    by_kind = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), same in by_kind.items():
        torch._foreach_mul_(same, factor.to(device=device, dtype=dtype))
