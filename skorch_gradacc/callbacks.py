"""Callbacks that know about gradient accumulation."""

import numbers

from skorch.callbacks import Callback, LRScheduler, ProgressBar

__all__ = ['AccumulationScheduler', 'GradAccLRScheduler', 'GradAccProgressBar']


class GradAccProgressBar(ProgressBar):
    """A :class:`skorch.callbacks.ProgressBar` that counts optimizer steps.

    skorch's progress bar expects ``batch_size`` samples per training batch.
    A gradient-accumulating net trains on groups of ``batch_size *
    acc_steps`` samples, one optimizer step each, so this bar is as long as
    the large-batch net's. It takes the same parameters as
    :class:`skorch.callbacks.ProgressBar`.

    You rarely need to name it: :class:`skorch_gradacc.GradAccMixin` uses it
    in place of any plain ``ProgressBar`` passed in ``callbacks``.

    Examples
    --------
    >>> from skorch.toy import make_classifier
    >>> from skorch_gradacc import GradAccNeuralNetClassifier
    >>> net = GradAccNeuralNetClassifier(
    ...     make_classifier(), batch_size=16, acc_steps=8,
    ...     callbacks=[GradAccProgressBar()])

    """

    def _get_batch_size(self, net, training):
        batch_size = super()._get_batch_size(net, training)
        get_acc_steps = getattr(net, 'get_acc_steps', None)
        if training and batch_size != -1 and get_acc_steps is not None:
            return batch_size * get_acc_steps()
        return batch_size


class GradAccLRScheduler(LRScheduler):
    """A :class:`skorch.callbacks.LRScheduler` that counts applied updates.

    When ``skip_nonfinite`` or the GradScaler of ``mixed_precision='fp16'``
    skips an optimizer step, a scheduler with ``step_every='batch'`` does
    not advance, so that it counts the updates that were applied, as
    skorch's scheduler does for Accelerate's skipped steps. It takes the
    same parameters as :class:`skorch.callbacks.LRScheduler`.

    You rarely need to name it: :class:`skorch_gradacc.GradAccMixin` uses it
    in place of any plain ``LRScheduler`` passed in ``callbacks``. A subclass
    of ``LRScheduler`` of your own is left as it is; derive it from this
    class instead to get the same behavior.

    Examples
    --------
    >>> import torch
    >>> from skorch.toy import make_classifier
    >>> from skorch_gradacc import GradAccNeuralNetClassifier
    >>> net = GradAccNeuralNetClassifier(
    ...     make_classifier(), batch_size=16, acc_steps=8, skip_nonfinite=True,
    ...     callbacks=[GradAccLRScheduler(torch.optim.lr_scheduler.StepLR,
    ...                                   step_size=1, step_every='batch')])

    """

    def on_batch_end(self, net, training, **kwargs):
        """Step per batch, unless the net skipped this batch's step."""
        self.skip_step_ = training and getattr(net, 'step_skipped_', False)
        try:
            super().on_batch_end(net, training, **kwargs)
        finally:
            self.skip_step_ = False

    def _step(self, net, lr_scheduler, score=None):
        if getattr(self, 'skip_step_', False):
            return
        super()._step(net, lr_scheduler, score=score)


class AccumulationScheduler(Callback):
    """Change ``acc_steps`` from epoch to epoch.

    The skorch counterpart of Lightning's ``GradientAccumulationScheduler``,
    and a way to "increase the batch size instead of decaying the learning
    rate" (Smith et al., 2018). The new value takes effect at the start of
    an epoch, never inside one: the epoch's micro-batches are grouped by
    it. Each epoch's value is recorded in the
    history as ``acc_steps``. Per-batch learning-rate schedulers keep
    counting optimizer steps. The net's ``acc_steps`` parameter is left as
    it is: the scheduled value lives in ``acc_steps_`` during training.

    Put it before a progress bar in ``callbacks``, so that the bar knows the
    epoch's number of steps.

    Parameters
    ----------
    schedule : dict or callable
      A dict ``{epoch: acc_steps}``: from each listed epoch on (epochs count
      from 1, as in the history), use that ``acc_steps``; before the first
      listed epoch, the net's own ``acc_steps``. Or a callable that takes
      the epoch number and returns ``acc_steps``.

    Examples
    --------
    >>> from skorch.toy import make_classifier
    >>> from skorch_gradacc import GradAccNeuralNetClassifier
    >>> net = GradAccNeuralNetClassifier(
    ...     make_classifier(), batch_size=16, max_epochs=6,
    ...     callbacks=[AccumulationScheduler({1: 1, 3: 2, 5: 4})])

    """

    def __init__(self, schedule):
        self.schedule = schedule

    def _acc_steps_for(self, epoch, default):
        if callable(self.schedule):
            return self.schedule(epoch)
        started = [key for key in self.schedule if key <= epoch]
        return self.schedule[max(started)] if started else default

    def on_train_begin(self, net, **kwargs):
        """Check a dict schedule before any training happens."""
        if callable(self.schedule):
            return
        if not isinstance(self.schedule, dict):
            raise ValueError(
                "AccumulationScheduler: schedule must be a dict or a callable, "
                "got {!r}.".format(self.schedule))
        for epoch, acc_steps in self.schedule.items():
            self._check(epoch, acc_steps)

    def on_epoch_begin(self, net, **kwargs):
        """Set and record the ``acc_steps`` of the epoch that begins."""
        epoch = len(net.history)  # the net has already opened this epoch
        acc_steps = self._acc_steps_for(epoch, net.acc_steps)
        self._check(epoch, acc_steps)
        net.acc_steps_ = int(acc_steps)
        net.history.record('acc_steps', net.acc_steps_)

    @staticmethod
    def _check(epoch, acc_steps):
        if (isinstance(acc_steps, bool)
                or not isinstance(acc_steps, numbers.Integral) or acc_steps < 1):
            raise ValueError(
                "AccumulationScheduler: the schedule gives acc_steps={!r} for "
                "epoch {!r}; it must be a positive integer.".format(
                    acc_steps, epoch))
