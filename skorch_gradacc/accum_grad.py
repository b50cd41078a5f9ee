"""Exact gradient accumulation for any PyTorch training loop.

:class:`AccumGrad` wraps a :class:`torch.optim.Optimizer` so that the
standard loop, ``zero_grad``, ``backward``, ``step``, accumulates the
gradients of ``acc_steps`` micro-batches and updates once with their mean,
like ``optax.MultiSteps`` in JAX and ``AccumGrad`` in Optimisers.jl. It
keeps no buffer of its own: the sum lives in the parameters' ``.grad``.
Inside skorch, use :class:`skorch_gradacc.GradAccMixin` instead.
"""


import weakref

import torch

from skorch_gradacc.batching import check_positive_int
from skorch_gradacc.counting import ItemCounts, scale_gradients

__all__ = ['AccumGrad']


# the AccumGrad that steps and updates each GradScaler: one per scaler, as
# its update() changes the scale that every other would unscale with
_SCALER_OWNERS = weakref.WeakKeyDictionary()


class AccumGrad(torch.optim.Optimizer):
    """Optimizer wrapper that steps once per ``acc_steps`` micro-batches.

    The loop stays the standard one: :meth:`zero_grad` clears the gradients
    only at the start of a group, each :meth:`step` counts a micro-batch and
    the ``acc_steps``-th normalizes the summed gradient to the group's mean
    and steps the wrapped optimizer once; :meth:`flush` steps a partial
    group. With losses that are means over different numbers of items,
    call :meth:`set_count` before each ``backward``; with summed losses,
    pass ``reduction='sum'``. The docs' page "Accumulation in any PyTorch
    loop" covers schedulers, hooks, mixed precision and checkpoints.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
      The optimizer to wrap, already built on the parameters. It must not
      need a closure (:class:`torch.optim.LBFGS` does).

    acc_steps : int
      A positive integer: the number of micro-batches per update.

    grad_scaler : torch.amp.GradScaler or None (default=None)
      For float16: scale each micro-batch's loss with it; the wrapper steps
      and updates it once per group (``stepped`` is False for a skipped
      update).

    reduction : 'mean' or 'sum' (default='mean')
      Whether each micro-batch's loss is a mean or a sum over its items.

    Attributes
    ----------
    optimizer : torch.optim.Optimizer
      The wrapped optimizer, whose ``param_groups``, ``state`` and
      ``defaults`` the wrapper shares.

    stepped : bool
      Whether the last :meth:`step` or :meth:`flush` applied an update: step
      a learning-rate scheduler when it is True.

    Examples
    --------
    >>> import torch
    >>> from skorch_gradacc import AccumGrad
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                 acc_steps=2)
    >>> X, y = torch.randn(5, 3), torch.randn(5, 1)
    >>> for Xi, yi in zip(X.split(2), y.split(2)):  # micro-batches 2, 2, 1
    ...     opt.zero_grad()
    ...     opt.set_count(len(yi))  # weight by rows: exact for the short one
    ...     torch.nn.functional.mse_loss(model(Xi), yi).backward()
    ...     opt.step()
    ...     print(opt.position, opt.stepped)
    1 False
    0 True
    1 False
    >>> opt.flush()  # the partial group of the last micro-batch
    >>> opt.stepped
    True

    """

    def __init__(self, optimizer, acc_steps, *, grad_scaler=None,
                 reduction='mean'):
        # Optimizer.__init__ is not called: the wrapped optimizer owns the
        # parameters, their groups and their state.
        if isinstance(optimizer, AccumGrad):
            raise TypeError(
                "optimizer is already an AccumGrad; wrap its inner optimizer "
                "(AccumGrad.optimizer) with the acc_steps you want instead.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, got {!r} of type "
                "{} instead.".format(optimizer, type(optimizer).__name__))
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer must not be LBFGS, which evaluates the loss several "
                "times per step and so cannot accumulate micro-batches.")
        check_positive_int('acc_steps', acc_steps)
        if grad_scaler is not None and not isinstance(
                grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                "grad_scaler must be a torch.amp.GradScaler or None, got {!r} "
                "instead.".format(grad_scaler))
        owner = grad_scaler and _SCALER_OWNERS.get(grad_scaler, lambda: None)()
        if owner is not None and owner.optimizer is not optimizer:
            raise ValueError(
                "grad_scaler is given to another AccumGrad already, whose update "
                "would change its scale before this one unscales; wrap one "
                "optimizer, with a param group per part, instead.")
        if not (isinstance(reduction, str) and reduction in ('mean', 'sum')):
            raise ValueError(
                "reduction must be 'mean' or 'sum', got {!r} instead."
                .format(reduction))
        self.optimizer = optimizer
        self.acc_steps = acc_steps
        self.grad_scaler = grad_scaler
        if grad_scaler is not None:
            _SCALER_OWNERS[grad_scaler] = weakref.ref(self)
        self.reduction = reduction
        self.stepped = False
        self._updated = False
        self._start_group()

    def _start_group(self):
        self._position = 0
        # .grad holds sum_j (count_j / unit) * gradient_j over the group's
        # micro-batches j (see ItemCounts); unit changes only when the
        # counts do.
        self._counts = ItemCounts(rescale=self._scale_grads)
        self._counted = None
        self._pending_count = False

    # The wrapped optimizer's attributes, shared, not copied: schedulers and
    # GradScaler.unscale_ read and write them through the wrapper.
    @property
    def param_groups(self):
        """The wrapped optimizer's ``param_groups`` (the same list)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @property
    def defaults(self):
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @property
    def position(self):
        """The number of micro-batches in the current group (0 between groups)."""
        return self._position

    @property
    def _opt_called(self):
        # A torch.optim.lr_scheduler attached to the wrapper sets this on
        # every step() call and warns when scheduler.step() comes first.
        # It is True only once an update was applied, so that the warning
        # also catches a scheduler stepped per micro-batch.
        return self._updated

    @_opt_called.setter
    def _opt_called(self, value):
        pass

    @property
    def _step_count(self):
        # What older schedulers (torch 2.3) check instead of _opt_called,
        # adding 1 on every step() call: the updates applied, for the same
        # warning.
        return int(self._updated)

    @_step_count.setter
    def _step_count(self, value):
        pass

    def _grads(self):
        return [param.grad for group in self.param_groups
                for param in group['params'] if param.grad is not None]

    def _scale_grads(self, scale):
        scale_gradients(self._grads(), scale)

    def zero_grad(self, set_to_none=True):
        """Clear the gradients at the start of a group; else do nothing.

        Parameters
        ----------
        set_to_none : bool (default=True)
          Passed on to the wrapped optimizer's ``zero_grad``.

        """
        if self._position == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def set_count(self, count):
        """Weight the coming micro-batch by the number of items of its loss.

        Call it before the micro-batch's ``backward``, for every micro-batch
        of a group or for none. The update is then that of the mean over all
        the group's items. A count of 0 (all padding) adds nothing: its
        backward must add a zero gradient, or be left out. A tensor count on
        a GPU is never read on the host.

        Parameters
        ----------
        count : int, float or one-element tensor
          A number of items, 0 or more.

        """
        count = self._counts.check(count, summed_ok=False)
        if self.reduction == 'sum':
            raise RuntimeError(
                "set_count weights mean losses; with reduction='sum' the "
                "losses are sums and are added up as they are.")
        if self._pending_count:
            raise RuntimeError(
                "set_count was called twice for one micro-batch; call it once "
                "before each backward, then step().")
        self._counts.add(count)
        self._pending_count = True

    def step(self, closure=None):
        """Count a micro-batch; on the ``acc_steps``-th, update once.

        Parameters
        ----------
        closure : callable or None (default=None)
          Called once, under :func:`torch.enable_grad`, for this
          micro-batch's loss and ``backward``; the wrapped optimizer never
          sees it.

        Returns
        -------
        loss
          What ``closure`` returned, or None.

        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        counted = self._pending_count
        if self._position == 0:
            self._counted = counted
        elif counted != self._counted:
            raise RuntimeError(
                "set_count must be called before the backward of every "
                "micro-batch of a group or of none; this group's micro-batch "
                "{} {} a count and the earlier ones {}.".format(
                    self._position + 1, 'has' if counted else 'has no',
                    'do not' if counted else 'do'))
        if not counted and self.reduction == 'mean':
            self._counts.add(1)  # equal counts: nothing is rescaled
        self._pending_count = False
        self._position += 1
        if self._position >= self.acc_steps:  # acc_steps may have shrunk
            self._update()
        else:
            self.stepped = False
        return loss

    def flush(self):
        """Update with a partial group, normalized by what it holds.

        Does nothing (and sets ``stepped`` to False) between groups.
        """
        if self._position == 0:
            self.stepped = False
        else:
            self._update()

    def _update(self):
        if self._counted and not self._grads() and not float(self._counts.total):
            # a group of 0 counts whose backward passes were left out: the
            # large batch's backward, every target ignored, gives zeros
            for param in (p for group in self.param_groups for p in group['params']):
                param.grad = torch.zeros_like(param) if param.requires_grad else None
        if self.reduction == 'mean':
            self._counts.normalize()
        if self.grad_scaler is None:
            self.optimizer.step()
            self.stepped = True
        else:
            scaler, applied = self.grad_scaler, []
            # unscaled before the step's pre-hooks (clipping) see it: the
            # scaler leaves a fused optimizer's to its kernel
            scaler.unscale_(self.optimizer)
            scale = scaler.get_scale()
            handle = self.optimizer.register_step_post_hook(
                lambda *args: applied.append(True))
            try:
                scaler.step(self.optimizer)
            finally:
                handle.remove()
            scaler.update()
            # the scaler skips the step, or a fused optimizer's kernel does,
            # when the gradient is not finite: then it lowers the scale
            self.stepped = bool(applied) and not scaler.get_scale() < scale
        self._updated = self._updated or self.stepped
        self._start_group()

    def state_dict(self):
        """Return the wrapped optimizer's state and the position in the group.

        Not the gradient of a group in progress, which is in ``.grad``.
        """
        return {
            'optimizer': self.optimizer.state_dict(),
            'acc_steps': self.acc_steps,
            'position': self._position,
            'unit': self._counts.count_unit,
            'total': self._counts.total,
            'counted': self._counted,
        }

    def load_state_dict(self, state_dict):
        """Load what :meth:`state_dict` returned.

        ``acc_steps`` stays this wrapper's own.

        Parameters
        ----------
        state_dict : dict
          The result of :meth:`state_dict`, or of the wrapped optimizer's
          class (a loop without accumulation): a group starts.

        """
        if 'optimizer' not in state_dict:  # a plain optimizer's, between steps
            self.optimizer.load_state_dict(state_dict)
            self._start_group()
            return
        if state_dict['position'] >= self.acc_steps:
            raise ValueError(
                "state_dict is at micro-batch {} of its group, which does not "
                "fit acc_steps={}.".format(state_dict['position'] + 1,
                                           self.acc_steps))
        self.optimizer.load_state_dict(state_dict['optimizer'])
        self._start_group()
        self._position = state_dict['position']
        self._counts.count_unit = state_dict['unit']
        self._counts.total = state_dict['total']
        self._counted = state_dict['counted']

    def add_param_group(self, param_group):
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook):
        """Register a hook that runs before each update, once per group."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        """Register a hook that runs after each update, once per group."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend=False):
        """Register a state-dict pre-hook on the wrapped optimizer."""
        return self.optimizer.register_state_dict_pre_hook(
            hook, prepend=prepend)

    def register_state_dict_post_hook(self, hook, prepend=False):
        """Register a hook on the wrapped optimizer's state dict."""
        return self.optimizer.register_state_dict_post_hook(
            hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend=False):
        """Register a load-state-dict pre-hook on the wrapped optimizer."""
        return self.optimizer.register_load_state_dict_pre_hook(
            hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook, prepend=False):
        """Register a load-state-dict post-hook on the wrapped optimizer."""
        return self.optimizer.register_load_state_dict_post_hook(
            hook, prepend=prepend)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop('step', None)  # patched in by a learning-rate scheduler
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self):
        return 'AccumGrad({!r}, acc_steps={})'.format(
            self.optimizer, self.acc_steps)

