"""Callbacks that know about gradient accumulation."""

from skorch.callbacks import ProgressBar

__all__ = ['GradAccProgressBar']


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
        if training and batch_size != -1:
            return batch_size * getattr(net, 'acc_steps', 1)
        return batch_size
