"""Callbacks that know about gradient accumulation."""

from skorch.callbacks import Callback

from skorch_gradacc.batching import is_positive_int

__all__ = ['AccumulationScheduler']


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
        if not is_positive_int(acc_steps):
            raise ValueError(
                "AccumulationScheduler: the schedule gives acc_steps={!r} for "
                "epoch {!r}; it must be a positive integer.".format(
                    acc_steps, epoch))
