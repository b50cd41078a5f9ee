"""Mixed precision, and whether an optimizer step is taken or skipped.

:class:`StepDecisionMixin` is a base of :class:`~skorch_gradacc.GradAccMixin`
and holds, in one place:

* autocast for each micro-batch's forward pass and loss
  (``mixed_precision='bf16'`` or ``'fp16'``);
* the GradScaler of ``'fp16'`` (every micro-batch's loss is scaled for
  ``backward`` in :meth:`skorch_gradacc.GradAccMixin._train_piece`): the
  gradient is unscaled once per group, and the scaler steps and updates
  once per group;
* the check for inf/NaN gradients of ``skip_nonfinite``;
* the step itself, entered through skorch's ``_step_optimizer`` as
  ``AccelerateMixin`` does: taken, or skipped with ``step_skipped_`` set;
* telling skorch's :class:`~skorch.callbacks.LRScheduler` about a skipped
  step, through the hook it reads for Accelerate's skipped steps,
  ``net.accelerator.optimizer_step_was_skipped``.
"""

import contextlib

import torch

from skorch_gradacc.engine import learnable_gradients

__all__ = ['AUTOCAST_DTYPES', 'StepDecisionMixin']

AUTOCAST_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}


class SkippedStepReport:
    """What skorch's LRScheduler reads of ``net.accelerator``.

    :meth:`skorch.callbacks.LRScheduler._step` does not step when
    ``net.accelerator.optimizer_step_was_skipped`` is true: that is how it
    counts the updates that Accelerate applied. A GradAcc net without an
    accelerator of its own answers through this object: true in the
    ``on_batch_end`` of a training batch whose step was skipped, false
    elsewhere, so epoch-level schedulers always step. It is a non-data
    descriptor of the net's class, bound to the net on access, so a net
    with ``AccelerateMixin`` has a real accelerator, which takes precedence.
    """

    def __init__(self, net=None):
        self.net = net

    def __get__(self, net, owner=None):
        return self if net is None else SkippedStepReport(net)

    @property
    def optimizer_step_was_skipped(self):
        """Whether the training batch that is ending skipped its step."""
        return getattr(self.net, '_batch_step_skipped_', False)


class StepDecisionMixin:
    """Autocast, loss scaling and the step-or-skip decision of a GradAcc net.

    Not used on its own: :class:`~skorch_gradacc.GradAccMixin` derives from
    it and owns the parameters ``mixed_precision`` and ``skip_nonfinite``.

    Attributes
    ----------
    grad_scaler_ : torch.amp.GradScaler or None
      The GradScaler of ``mixed_precision='fp16'``, created at the first
      training step.

    step_skipped_ : bool
      Whether the last training step was skipped.

    """

    accelerator = SkippedStepReport()

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        """Nothing is skipped before a batch's step."""
        super().on_batch_begin(net, batch=batch, training=training, **kwargs)
        self._batch_step_skipped_ = False

    def on_batch_end(self, net, batch=None, training=False, **kwargs):
        """Report a skipped training step to the callbacks that follow."""
        super().on_batch_end(net, batch=batch, training=training, **kwargs)
        # the net's own hook runs before the callbacks' in skorch's notify
        self._batch_step_skipped_ = bool(
            training and getattr(self, 'step_skipped_', False))

    def on_epoch_end(self, net, **kwargs):
        """Epoch-level schedulers step whatever the last batch did."""
        super().on_epoch_end(net, **kwargs)
        self._batch_step_skipped_ = False

    def _decides_step(self):
        """Whether the net, not the optimizer alone, decides about each step."""
        return self.skip_nonfinite or self.mixed_precision == 'fp16'

    def _device_type(self):
        return torch.device(self.device).type if self.device else 'cpu'

    def _autocast(self):
        """Return the context for one micro-batch's forward and backward."""
        if self.mixed_precision is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type(),
                              dtype=AUTOCAST_DTYPES[self.mixed_precision])

    def _get_grad_scaler(self):
        """Return the GradScaler of ``mixed_precision='fp16'``, else None."""
        if self.mixed_precision != 'fp16':
            return None
        if getattr(self, 'grad_scaler_', None) is None:
            self.grad_scaler_ = self._make_grad_scaler()
        return self.grad_scaler_

    def _make_grad_scaler(self):
        return torch.amp.GradScaler(self._device_type())

    def _unscale_gradients(self):
        """Undo the GradScaler's scale, once per group, before callbacks."""
        scaler = self._get_grad_scaler()
        if scaler is None:
            return
        for name in self._optimizers:
            scaler.unscale_(getattr(self, name + '_'))

    def _gradients_are_finite(self):
        grads = learnable_gradients(self)
        finite = not grads or bool(
            torch.stack([torch.isfinite(grad).all() for grad in grads]).all())
        # every rank decides alike, also with gradient shards (FSDP2)
        return self.get_engine().all_ranks(finite)

    def _step_optimizer(self, step_fn):
        """Step all optimizers, unless the step is to be skipped.

        A skipped step leaves parameters and optimizer state unchanged, zeroes
        the gradient, sets ``step_skipped_`` (which per-batch
        :class:`skorch.callbacks.LRScheduler` callbacks learn through
        :class:`SkippedStepReport`) and records ``step_skipped=True`` in the
        batch's history row.

        """
        if not self._decides_step():
            self.step_skipped_ = False
            return super()._step_optimizer(step_fn)
        # closure optimizers (LBFGS) are refused with these options, so the
        # closure is called once, here
        step_fn()
        scaler = self._get_grad_scaler()
        if self.skip_nonfinite and not self._gradients_are_finite():
            if scaler is not None:
                scaler.update()  # unscale_ saw the inf: lower the scale
            skipped = True
        elif scaler is None:
            super()._step_optimizer(None)
            skipped = False
        else:
            scale = scaler.get_scale()
            for name in self._optimizers:
                scaler.step(getattr(self, name + '_'))
            scaler.update()
            # on inf/NaN the scaler skips the step and lowers the scale
            skipped = scaler.get_scale() < scale
        if skipped:
            self._zero_grad_optimizer()
        self.step_skipped_ = skipped
        self.history.record_batch('step_skipped', skipped)
        return None
