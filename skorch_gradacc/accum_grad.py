"""Exact gradient accumulation for any PyTorch training loop.

:class:`AccumGrad` wraps a :class:`torch.optim.Optimizer` so that the
standard loop, ``zero_grad``, ``backward``, ``step``, accumulates the
gradients of ``acc_steps`` micro-batches and updates once with their mean,
like ``optax.MultiSteps`` in JAX and ``AccumGrad`` in Optimisers.jl. It
keeps no buffer of its own: the sum lives in the parameters' ``.grad``.
Inside skorch, use :class:`skorch_gradacc.GradAccMixin` instead.
"""


import torch

from skorch_gradacc.batching import check_positive_int
from skorch_gradacc.counting import ItemCounts, scale_gradients

__all__ = ['AccumGrad']


class AccumGrad(torch.optim.Optimizer):
    """Optimizer wrapper that steps once per ``acc_steps`` micro-batches.

    The loop stays the standard one; each ``step()`` call counts one
    micro-batch:

    * :meth:`zero_grad` clears the gradients at the start of a group and
      does nothing in the middle of one, so that ``backward`` adds up the
      gradients of the group's micro-batches in ``.grad``.
    * :meth:`step` counts micro-batches. The ``acc_steps``-th call
      normalizes the summed gradient to the group's mean and steps the
      wrapped optimizer once; the other calls do nothing else.
    * :meth:`flush` steps a partial group, normalized by what it holds (call
      it at the end of an epoch whose micro-batches ``acc_steps`` does not
      divide).

    With equal micro-batches, this is the large-batch loop: each update is
    the one the wrapped optimizer makes on the group as one batch. When the
    losses are means over different numbers of items (a short last
    micro-batch, tokens), call :meth:`set_count` with the number before each
    ``backward``: the update is then that of the mean over all the items of
    the group, still without a second copy of the gradients. When the
    losses are sums, not means, pass ``reduction='sum'``: the gradients are
    then added up and never divided.

    Attributes
    ----------
    optimizer : torch.optim.Optimizer
      The wrapped optimizer. ``param_groups``, ``state`` and ``defaults``
      are its own, so a learning-rate scheduler built on the wrapper
      changes its learning rates.

    acc_steps : int
      The number of ``step()`` calls (micro-batches) per update.

    stepped : bool
      Whether the last :meth:`step` or :meth:`flush` applied an update. A
      loop steps its learning-rate scheduler when it is True, so that the
      scheduler counts updates, as in the large-batch loop.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
      The optimizer to wrap, already built on the parameters. It must not
      need a closure (:class:`torch.optim.LBFGS` does).

    acc_steps : int
      A positive integer: the number of micro-batches per update.

    grad_scaler : torch.amp.GradScaler or None (default=None)
      For mixed precision with float16: scale each micro-batch's loss with
      it, ``grad_scaler.scale(loss).backward()``, and leave the rest to the
      wrapper. Once per group, the wrapper calls ``grad_scaler.step`` (which
      unscales the gradient and skips the update if it holds inf or NaN)
      and ``grad_scaler.update``; ``stepped`` is False for a skipped update.

    reduction : 'mean' or 'sum' (default='mean')
      How each micro-batch's loss reduces over its items. ``'mean'``: the
      update is that of the mean over the group, by micro-batches or by the
      counts given to :meth:`set_count`. ``'sum'``: the loss is a sum, e.g.
      of a criterion with ``reduction='sum'``, and the update is that of the
      sum over the group; :meth:`set_count` is not used.

    Notes
    -----
    Hooks go to the wrapped optimizer and receive it as their first
    argument. Step hooks (:meth:`register_step_pre_hook`, e.g. gradient
    clipping, and :meth:`register_step_post_hook`) run once per update, on
    the normalized and unscaled gradient; state-dict hooks
    (:meth:`register_state_dict_pre_hook` and the like) see the wrapped
    optimizer's state dict, the ``'optimizer'`` entry of the wrapper's.

    Counts may be tensors on the gradients' device, e.g. ``(y !=
    -100).sum()`` (see :meth:`set_count`).

    The gradient of a group in progress is in the parameters' ``.grad``, not
    in :meth:`state_dict`. Save checkpoints at group boundaries
    (``position == 0``, e.g. after :meth:`flush`), or save the ``.grad``
    tensors too.

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
        if not (isinstance(reduction, str) and reduction in ('mean', 'sum')):
            raise ValueError(
                "reduction must be 'mean' or 'sum', got {!r} instead."
                .format(reduction))
        self.optimizer = optimizer
        self.acc_steps = acc_steps
        self.grad_scaler = grad_scaler
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
        """The number of micro-batches in the current group (0 between groups).

        ``step()`` completes the group when ``position == acc_steps - 1``.
        """
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

        Call it before the micro-batch's ``backward``, with the number of
        items its loss is the mean of (rows, or non-padding tokens). The
        update is then that of the mean loss over all the items of the
        group, e.g. with a short last micro-batch. Call it for every
        micro-batch of a group or for none. When the count differs from the
        previous micro-batch's, the gradients summed so far are rescaled in
        place, once: no second copy of the gradients is kept.

        A count of 0 says that the micro-batch has no item (all its tokens
        are padding): it adds nothing to the mean, so its backward must add
        a zero gradient, as :class:`torch.nn.CrossEntropyLoss` with every
        target ignored does (a mean written ``sum / count`` gives NaN: divide
        by ``count.clamp(min=1)``), or be left out. A group whose counts are
        all 0 is stepped with the gradient its losses gave, as the large
        batch is.

        A tensor count on a GPU (any device but the CPU) is never read on
        the host, so no micro-batch waits for the device: the gradients are
        then rescaled with a tensor factor at every micro-batch, and the
        count's value is not checked. A tensor on the CPU is read, which
        waits for nothing, and counts as a number.

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
          If given, it is called once, under :func:`torch.enable_grad`, to
          compute this micro-batch's loss and ``backward`` (its own
          ``zero_grad`` call is the wrapper's). The wrapped optimizer never
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
        if self.reduction == 'mean':
            self._counts.normalize()
        if self.grad_scaler is None:
            self.optimizer.step()
            self.stepped = True
        else:
            # the scaler skips the inner step when the gradient is not finite
            applied = []
            handle = self.optimizer.register_step_post_hook(
                lambda *args: applied.append(True))
            try:
                self.grad_scaler.step(self.optimizer)
            finally:
                handle.remove()
            self.grad_scaler.update()
            self.stepped = bool(applied)
        self._updated = self._updated or self.stepped
        self._start_group()

    def state_dict(self):
        """Return the wrapped optimizer's state and the position in the group.

        The gradient of a group in progress is not included: it is in the
        parameters' ``.grad``.
        """
        return {
            'optimizer': self.optimizer.state_dict(),
            'acc_steps': self.acc_steps,
            'position': self._position,
            'unit': self._counts.unit,
            'total': self._counts.total,
            'counted': self._counted,
        }

    def load_state_dict(self, state_dict):
        """Load what :meth:`state_dict` returned.

        ``acc_steps`` stays this wrapper's own.

        Parameters
        ----------
        state_dict : dict
          The result of :meth:`state_dict`.

        """
        if state_dict['position'] >= self.acc_steps:
            raise ValueError(
                "state_dict is at micro-batch {} of its group, which does not "
                "fit acc_steps={}.".format(state_dict['position'] + 1,
                                           self.acc_steps))
        self.optimizer.load_state_dict(state_dict['optimizer'])
        self._start_group()
        self._position = state_dict['position']
        self._counts.unit = state_dict['unit']
        self._counts.total = state_dict['total']
        self._counted = state_dict['counted']

    def add_param_group(self, param_group):
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook):
        """Register a hook that runs before each update, once per group.

        It is registered on the wrapped optimizer: see
        :meth:`torch.optim.Optimizer.register_step_pre_hook`.
        """
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        """Register a hook that runs after each update, once per group.

        It is registered on the wrapped optimizer: see
        :meth:`torch.optim.Optimizer.register_step_post_hook`.
        """
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend=False):
        """Register a hook that runs before the wrapped optimizer's state dict.

        It is registered on the wrapped optimizer: see
        :meth:`torch.optim.Optimizer.register_state_dict_pre_hook`.
        """
        return self.optimizer.register_state_dict_pre_hook(
            hook, prepend=prepend)

    def register_state_dict_post_hook(self, hook, prepend=False):
        """Register a hook that may change the wrapped optimizer's state dict.

        It is registered on the wrapped optimizer: see
        :meth:`torch.optim.Optimizer.register_state_dict_post_hook`. The
        dict it receives is the ``'optimizer'`` entry of :meth:`state_dict`.
        """
        return self.optimizer.register_state_dict_post_hook(
            hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend=False):
        """Register a hook that runs before the wrapped optimizer loads its state.

        It is registered on the wrapped optimizer: see
        :meth:`torch.optim.Optimizer.register_load_state_dict_pre_hook`. The
        dict it receives is the ``'optimizer'`` entry of the dict given to
        :meth:`load_state_dict`.
        """
        return self.optimizer.register_load_state_dict_pre_hook(
            hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook, prepend=False):
        """Register a hook that runs after the wrapped optimizer loads its state.

        It is registered on the wrapped optimizer: see
        :meth:`torch.optim.Optimizer.register_load_state_dict_post_hook`.
        """
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

