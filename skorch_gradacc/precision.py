"""Mixed precision and skipped steps: how each pass runs, whether a step is taken.

:class:`PrecisionMixin`, a base of :class:`~skorch_gradacc.GradAccMixin`,
runs each micro-batch's forward pass and loss under :meth:`autocast`
(``mixed_precision``), scales each loss with fp16's GradScaler and
unscales, steps and updates once per step, and skips a step whose
gradient is not finite (``skip_nonfinite``): parameters and optimizer
state stay, the history records it, and skorch's ``LRScheduler`` does not
advance (:class:`SkippedStepReport`).
"""

import contextlib
import functools

import torch

from skorch_gradacc.batching import cast_outputs
from skorch_gradacc.engine import learnable_gradients

__all__ = []

AUTOCAST_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}


class SkippedStepReport:
    """The net's ``accelerator``: what skorch's LRScheduler reads of one.

    Not an accelerator. ``LRScheduler`` does not step when
    ``net.accelerator.optimizer_step_was_skipped`` is true (Accelerate's
    skipped steps). A net without an accelerator answers through this
    non-data descriptor: true in the ``on_batch_end`` of a skipped step.
    An ``AccelerateMixin`` net's own accelerator takes precedence.
    """

    def __init__(self, net=None):
        self.net = net

    def __get__(self, net, owner=None):
        return self if net is None else SkippedStepReport(net)

    @property
    def optimizer_step_was_skipped(self):
        """Whether the training batch that is ending skipped its step."""
        return getattr(self.net, '_batch_step_skipped_', False)


def save_scaler_state(scaler, optimizer, state_dict):
    """Add the GradScaler's state to an optimizer's (a ``state_dict`` hook)."""
    state_dict['grad_scaler'] = scaler.state_dict()


def load_scaler_state(scaler, optimizer, state_dict):
    """Restore the GradScaler's state saved with an optimizer's (a hook)."""
    if 'grad_scaler' in state_dict:  # saved with fp16
        scaler.load_state_dict(state_dict.pop('grad_scaler'))


class PrecisionMixin:
    """Mixed precision and skipped steps, for a GradAcc net.

    It reads the net's ``mixed_precision`` and ``skip_nonfinite`` and sets
    ``grad_scaler_`` and ``step_skipped_``
    (:class:`~skorch_gradacc.GradAccMixin` documents them).
    """

    # skorch's LRScheduler asks net.accelerator whether Accelerate skipped
    # the step; a net without an accelerator answers here (docs: upstream)
    accelerator = SkippedStepReport()

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        """Nothing is skipped before a batch's step."""
        super().on_batch_begin(net, batch=batch, training=training, **kwargs)
        self._batch_step_skipped_ = False

    def on_batch_end(self, net, batch=None, training=False, **kwargs):
        """Report a skipped step to the callbacks."""
        super().on_batch_end(net, batch=batch, training=training, **kwargs)
        # the net's own hook runs before the callbacks' in skorch's notify
        self._batch_step_skipped_ = bool(
            training and getattr(self, 'step_skipped_', False))

    def _decides_step(self):
        """Whether the net, not the optimizer alone, decides about each step."""
        return self.skip_nonfinite or self.mixed_precision == 'fp16'

    def _device_type(self):
        return torch.device(self.device).type if self.device else 'cpu'

    def autocast(self):
        """Return the context of one micro-batch's forward pass and loss.

        :class:`torch.autocast` with the dtype of ``mixed_precision``, or a
        null context. Override it for another precision scheme (FSDP2's
        mixin returns a null context: its policy casts the module).
        """
        if self.mixed_precision is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type(),
                              dtype=AUTOCAST_DTYPES[self.mixed_precision])

    def in_module_dtype(self, output):
        """Return ``output`` (or None), with mixed precision in the module's dtype.

        What callbacks and predictions get of passes in low precision: the
        dtype a module runs in without autocast (numpy has no bfloat16).
        """
        if self.mixed_precision is None or output is None:
            return output
        dtype = next((param.dtype for param in self.module_.parameters()
                      if param.is_floating_point()), None)
        return output if dtype is None else cast_outputs(output, dtype)

    def initialize_optimizer(self, *args, **kwargs):
        """Initialize the optimizers; with fp16, they carry the GradScaler.

        The ``state_dict`` of each holds the scaler's state too (key
        ``'grad_scaler'``, which plain optimizers ignore), and its
        ``load_state_dict`` restores it: ``save_params``, ``load_params``
        and skorch's ``Checkpoint`` resume at the scale reached.
        """
        super().initialize_optimizer(*args, **kwargs)
        if getattr(self, 'grad_scaler_', None) is None:
            self._get_grad_scaler()  # made, it hooks them
        else:
            self._hook_grad_scaler()
        return self

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        """With fp16, the GradScaler exists before callbacks load a checkpoint."""
        # after set_params(mixed_precision='fp16') on an initialized net;
        # the net's own hook runs before the callbacks' (LoadInitState)
        self._get_grad_scaler()
        super().on_train_begin(net, X=X, y=y, **kwargs)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._hook_grad_scaler()  # optimizers unpickle without hooks

    def _hook_grad_scaler(self):
        """With fp16, have each optimizer save and load the GradScaler."""
        scaler = getattr(self, 'grad_scaler_', None)
        if scaler is None or self.mixed_precision != 'fp16':
            return
        for name in self._optimizers:
            optimizer = getattr(self, name + '_', None)  # None: uninitialized
            if optimizer is not None:
                optimizer.register_state_dict_post_hook(
                    functools.partial(save_scaler_state, scaler))
                optimizer.register_load_state_dict_pre_hook(
                    functools.partial(load_scaler_state, scaler))

    def _get_grad_scaler(self):
        """Return the GradScaler of ``mixed_precision='fp16'``, else None."""
        if self.mixed_precision != 'fp16':
            return None
        if getattr(self, 'grad_scaler_', None) is None:
            self.grad_scaler_ = self.make_grad_scaler()
            self._hook_grad_scaler()
        return self.grad_scaler_

    def make_grad_scaler(self):
        """Return a new GradScaler for ``mixed_precision='fp16'``."""
        return torch.amp.GradScaler(self._device_type())

    def _unscale_gradients(self):
        """Undo the GradScaler's scale, once per group, before callbacks."""
        scaler = self._get_grad_scaler()
        if scaler is None:
            return
        if getattr(self, '_unscaled_', False):
            # a step ended after unscale_ (an error or Ctrl-C in a callback):
            # the scaler takes no unscale_ before an update(), which keeps
            # its scale when given it
            scaler.update(scaler.get_scale())
        for name in self._optimizers:
            scaler.unscale_(getattr(self, name + '_'))
        self._unscaled_ = True

    def _gradients_are_finite(self):
        grads = learnable_gradients(self)
        finite = not grads or bool(
            torch.stack([torch.isfinite(grad).all() for grad in grads]).all())
        # every rank decides alike, also with gradient shards (FSDP2)
        return self.get_engine().all_ranks(finite)

    def _step_optimizer(self, step_fn):
        """Step all optimizers, unless the step is to be skipped.

        A skipped step (``skip_nonfinite``, or fp16's GradScaler) leaves
        parameters and optimizer state unchanged, zeroes the gradient, sets
        ``step_skipped_`` and records ``step_skipped=True``.
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
                self._unscaled_ = False
            skipped = True
        elif scaler is None:
            super()._step_optimizer(None)
            skipped = False
        else:
            scale = scaler.get_scale()
            for name in self._optimizers:
                scaler.step(getattr(self, name + '_'))
            scaler.update()
            self._unscaled_ = False
            # on inf/NaN the scaler skips the step and lowers the scale
            skipped = scaler.get_scale() < scale
        if skipped:
            self._zero_grad_optimizer()
        self.step_skipped_ = skipped
        self.history.record_batch('step_skipped', skipped)
        return None

    def on_epoch_end(self, net, **kwargs):
        """Record the epoch's skipped steps, where steps may be skipped."""
        super().on_epoch_end(net, **kwargs)
        self._batch_step_skipped_ = False  # epoch-level schedulers step
        if self._decides_step():
            skipped = sum(row.get('step_skipped', False)
                          for row in self.history[-1, 'batches'])
            self.history.record('skipped_steps', skipped)
