"""The mixin that gives a skorch net exact gradient accumulation.

Where things happen, one place each: the groups of micro-batches,
:meth:`GradAccMixin.run_single_epoch` and :mod:`skorch_gradacc.grouping`;
the step, :meth:`GradAccMixin.train_step`; forward, backward and the
weighting of each micro-batch, :meth:`GradAccMixin.accumulate_gradients`;
mixed precision and skipped steps, :meth:`GradAccMixin._step_optimizer`;
what differs between one process, DDP and FSDP2, the engine
(:mod:`skorch_gradacc.engine`).
"""

import contextlib
import functools
import inspect
import sys
import types

import numpy as np
import torch
from skorch.utils import TeeGenerator
from torch.utils.data import DistributedSampler

from skorch_gradacc.batching import (
    arrays_in,
    batch_len,
    check_positive_int,
    concat_outputs,
    detach_outputs,
    split_batch,
)
from skorch_gradacc.callbacks import (
    callback_reads,
    count_steps_in_progress_bars,
    train_batch_reads,
)
from skorch_gradacc.counting import (
    ItemCounts,
    check_loss_is_mean,
    count_items,
    scale_gradients,
    snapshot_buffers,
    weighted_mean,
)
from skorch_gradacc.engine import (
    DataParallelEngine,
    Engine,
    engine_for,
    learnable_gradients,
)
from skorch_gradacc.grouping import MicroBatchGroup
from skorch_gradacc.memory import (
    back_off,
    backed_off_size,
    backs_off,
    is_out_of_memory,
    parse_budget,
    plan_memory,
    record_measured_peak,
    split_micro_batch,
)

__all__ = ['GradAccMixin']

AUTOCAST_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}

# the micro-batches the loss check tries before it gives up undecided
LOSS_CHECK_TRIES = 3


class SkippedStepReport:
    """What skorch's LRScheduler reads of ``net.accelerator``.

    ``LRScheduler`` does not step when
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


class GradAccMixin:
    """Mixin class that adds exact gradient accumulation to a skorch net.

    Use it in front of one of skorch's net classes, e.g. ``class
    MyNet(GradAccMixin, NeuralNetClassifier)``, or use one of the ready-made
    classes such as :class:`skorch_gradacc.GradAccNeuralNetClassifier`.

    With ``acc_steps=k``, the net takes one optimizer step per group of
    ``k`` consecutive micro-batches of its training iterator, as
    configured, holding one micro-batch at a time. Training is that of
    plain skorch on the groups (``batch_size=B * k``): the same parameters,
    history (one row per step) and callback calls. Validation runs at
    ``batch_size``. The docs' "How it works" page says how, and its
    compatibility page what cannot match.

    Parameters
    ----------
    acc_steps : int (default=1)
      The number of consecutive micro-batches of the training iterator whose
      gradients are accumulated into each optimizer step. ``acc_steps=1``
      is plain skorch. Larger values than the number of micro-batches in an
      epoch are allowed and give one step per epoch.

    micro_batch_size : int, 'auto' or None (default=None)
      Split each training micro-batch, and each validation and prediction
      batch, into pieces of at most this many rows for the forward pass;
      the batches that the history and callbacks see are unchanged. With
      ``'auto'``, the net plans the largest pieces that fit
      ``memory_budget`` before the first step, and an out-of-memory error
      (CUDA's or the CPU allocator's) halves them and replays the group,
      with the same update (see the docs' memory page).

    memory_budget : None, int or str (default=None)
      With ``micro_batch_size='auto'`` only: the bytes the fit may add to
      what the process holds after ``initialize()``, e.g. ``'2GiB'``. None:
      what the device still gives
      (:func:`skorch_gradacc.memory.available_memory`).

    skip_nonfinite : bool (default=False)
      Skip a step whose accumulated gradient holds inf or NaN: parameters
      and optimizer state stay unchanged, per-batch schedulers do not
      advance, and the history records ``step_skipped`` and
      ``skipped_steps``.

    mixed_precision : None, 'bf16' or 'fp16' (default=None)
      Run each micro-batch's forward pass and loss under
      :class:`torch.autocast` with this dtype. ``'fp16'`` adds a
      :class:`torch.amp.GradScaler` that scales each loss and unscales,
      steps and updates once per group.

    check_loss : bool (default=True)
      Check once in a fit from scratch that trains in groups (not at
      ``acc_steps=1`` without options), with three extra forward passes of
      one piece (and its halves; with ``'auto'``, of the plan's passes'
      sizes) and no side effect, that the loss is a mean over what
      :meth:`count_loss_items` counts; else warn with a
      :class:`~skorch_gradacc.LossItemsWarning`. Undecided (a loss that is
      not finite, no items), it tries the next micro-batch: 3 at most.

    Attributes
    ----------
    micro_batch_size_ : int or None
      With ``micro_batch_size='auto'``, the size found to fit; None while
      whole micro-batches fit.

    memory_plan_ : dict or None
      With ``micro_batch_size='auto'``, the plan made before the first
      step: ``'budget'``, ``'micro_batch_size'``, ``'max_cost'`` (of a
      piece, in ``'unit'``), ``'predicted_peak'``, ``'measured_peak'``
      (bytes, over the first step), ``'plan_seconds'`` (the loss check's
      apart, ``'loss_check_seconds'``), ``'passes'`` (its forward and
      backward passes), ``'code_per_shape'`` (bytes a new shape compiles,
      counted under ``RLIMIT_AS``) and the fit's terms.

    grad_scaler_ : torch.amp.GradScaler or None
      The GradScaler of ``mixed_precision='fp16'``.

    engine_ : skorch_gradacc.engine.Engine
      The engine of ``module_`` (one process, DDP, FSDP2); see
      :meth:`get_engine`.

    step_skipped_ : bool
      Whether the last training step was skipped.

    Examples
    --------
    >>> import numpy as np
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.toy import make_classifier
    >>> from skorch_gradacc import GradAccMixin
    >>> class GradAccNet(GradAccMixin, NeuralNetClassifier):
    ...     '''NeuralNetClassifier with gradient accumulation'''
    >>> X = np.random.randn(100, 20).astype(np.float32)
    >>> y = np.random.randint(0, 2, size=100)
    >>> net = GradAccNet(make_classifier(), batch_size=8, acc_steps=4,
    ...                  max_epochs=2, verbose=0)
    >>> _ = net.fit(X, y)
    >>> net.history[-1, 'train_batch_count']  # ceil(80 / 8 / 4) steps
    3

    """

    accelerator = SkippedStepReport()

    # The parameters are the keyword-only parameters of this __init__; the
    # signature that scikit-learn reads is built from it (see
    # __init_subclass__).
    def __init__(self, *args, acc_steps=1, micro_batch_size=None,
                 skip_nonfinite=False, mixed_precision=None, check_loss=True,
                 memory_budget=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps
        self.micro_batch_size = micro_batch_size
        self.skip_nonfinite = skip_nonfinite
        self.mixed_precision = mixed_precision
        self.check_loss = check_loss
        self.memory_budget = memory_budget

    def __init_subclass__(cls, **kwargs):
        # scikit-learn's estimator checks read the parameters from the
        # signature of __init__. Give each subclass an __init__ whose
        # signature is that of the net it extends plus the parameters of the
        # mixins in front of it, this one included.
        super().__init_subclass__(**kwargs)
        if '__init__' in vars(cls):
            return

        def __init__(self, *args, **kwargs):
            super(cls, self).__init__(*args, **kwargs)

        __init__.__signature__ = _combined_signature(cls)
        __init__.__qualname__ = cls.__qualname__ + '.__init__'
        __init__._generated_by_grad_acc = True
        cls.__init__ = __init__

    # Validation, before any training happens

    def _validate_params(self):
        super()._validate_params()
        self._check_grad_acc_params()
        self._check_accelerate()

    def check_training_readiness(self):
        """Check that the net is ready to train, its own parameters included."""
        super().check_training_readiness()
        # set_params() does not run _validate_params for ordinary attributes,
        # so a bad value set after initialization is caught here, before any
        # training happens.
        self._check_grad_acc_params()

    def _check_grad_acc_params(self):
        check_positive_int('acc_steps', self.acc_steps)
        if not (self.micro_batch_size is None or self.micro_batch_size == 'auto'):
            check_positive_int('micro_batch_size', self.micro_batch_size,
                               "None, 'auto' or ")
        parse_budget(self.memory_budget)
        if self.memory_budget is not None and self.micro_batch_size != 'auto':
            raise ValueError(
                "memory_budget={!r} needs micro_batch_size='auto', got {!r}; "
                "set micro_batch_size='auto' or memory_budget=None.".format(
                    self.memory_budget, self.micro_batch_size))
        for name in ('skip_nonfinite', 'check_loss'):
            if not isinstance(getattr(self, name), bool):
                raise ValueError("{} must be True or False, got {!r} instead."
                                 .format(name, getattr(self, name)))
        if not (self.mixed_precision is None
                or isinstance(self.mixed_precision, str)
                and self.mixed_precision in AUTOCAST_DTYPES):
            raise ValueError(
                "mixed_precision must be None, 'bf16' or 'fp16', got {!r} "
                "instead.".format(self.mixed_precision))
        if self._decides_step() and any(
                isinstance(getattr(self, name + '_', None), torch.optim.LBFGS)
                for name in self._optimizers):
            raise ValueError(
                "skip_nonfinite=True and mixed_precision='fp16' cannot be used "
                "with LBFGS, which evaluates the loss several times per step.")

    def _check_accelerate(self):
        """Refuse combinations with ``AccelerateMixin`` that would be wrong."""
        hf = sys.modules.get('skorch.hf')  # not imported: not an AccelerateMixin
        if hf is None or not isinstance(self, hf.AccelerateMixin):
            return
        name = type(self).__name__
        mro = type(self).__mro__
        if mro.index(GradAccMixin) < mro.index(hf.AccelerateMixin):
            raise ValueError(
                "Put AccelerateMixin before GradAccMixin in the bases of {}, "
                "e.g. class {}(AccelerateMixin, GradAccMixin, "
                "NeuralNetClassifier), so that the accelerator prepares the "
                "training iterator.".format(name, name))
        steps = getattr(self.accelerator, 'gradient_accumulation_steps', 1)
        if steps != 1:
            raise ValueError(
                "The accelerator accumulates gradients itself "
                "(gradient_accumulation_steps={}); with GradAccMixin, create "
                "it with gradient_accumulation_steps=1 and set acc_steps={} on "
                "the net instead.".format(steps, steps))
        if self._decides_step() or self.mixed_precision is not None:
            raise ValueError(
                "With AccelerateMixin, the accelerator steps the optimizer: "
                "leave mixed_precision=None and skip_nonfinite=False on {} "
                "(got mixed_precision={!r}, skip_nonfinite={!r}) and use the "
                "accelerator's mixed_precision option instead.".format(
                    name, self.mixed_precision, self.skip_nonfinite))

    # Initialization

    def initialize_callbacks(self):
        """Initialize the callbacks, and check what they read of a batch.

        A bad ``train_batch_reads`` (see :meth:`get_train_outputs_needed`)
        raises a ValueError here, before any training.
        """
        super().initialize_callbacks()
        for _, cb in self.callbacks_:
            callback_reads(self, cb)
        return self

    def notify(self, method_name, **cb_kwargs):
        """Call the callbacks, as skorch does.

        After ``on_epoch_begin``, a :class:`skorch.callbacks.ProgressBar`
        with ``batches_per_epoch='auto'`` is told the epoch's optimizer steps.
        """
        super().notify(method_name, **cb_kwargs)
        if method_name == 'on_epoch_begin':
            count_steps_in_progress_bars(
                self, cb_kwargs.get('dataset_train'), self.get_acc_steps())

    def initialize(self):
        """Initialize the net; ``micro_batch_size='auto'`` starts afresh."""
        self.micro_batch_size_ = None
        self.memory_plan_ = self._memory_meter_ = None
        self.grad_scaler_ = None
        return super().initialize()

    # Batch sizes and acc_steps in force

    def get_micro_batch_size(self):
        """Return the most rows that go through the module at once in training.

        ``micro_batch_size``, the size found so far with ``'auto'``, or None
        for whole micro-batches.
        """
        if self.micro_batch_size == 'auto':
            return getattr(self, 'micro_batch_size_', None)
        return self.micro_batch_size

    def get_acc_steps(self):
        """Return the ``acc_steps`` in force for the current epoch.

        ``acc_steps``, unless an :class:`~skorch_gradacc.AccumulationScheduler`
        set ``acc_steps_`` for this epoch.
        """
        scheduled = getattr(self, 'acc_steps_', None)
        return self.acc_steps if scheduled is None else scheduled

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        """Forget a schedule's ``acc_steps`` from an earlier fit.

        A fit from scratch (empty history) checks its loss (``check_loss``).
        """
        super().on_train_begin(net, X=X, y=y, **kwargs)
        self.acc_steps_ = None
        # the micro-batches the check may still try
        self.loss_check_pending_ = (
            LOSS_CHECK_TRIES if self.check_loss and not len(self.history) else 0)

    # The epoch: one batch per group

    def get_train_outputs_needed(self):
        """Return what is kept of a training group for the callbacks.

        A group's micro-batches are freed after their backward pass unless
        a callback reads them in ``on_batch_begin``, ``on_grad_computed`` or
        ``on_batch_end``; then the group keeps what the large-batch net would
        pass. skorch's own callbacks are known; a callback of your own
        declares what it reads in the class attribute ``train_batch_reads``,
        a collection of ``'X'``, ``'y'`` and ``'y_pred'``, or ``()``. One that
        declares nothing and overrides a batch method gets everything, with
        a warning. The inputs are also kept for an optimizer that evaluates
        the group again and with ``micro_batch_size='auto'``. The docs' memory
        page gives the details.

        Returns
        -------
        needed : dict
          ``{'batch': bool, 'y': bool, 'y_pred': bool}``: whether the group
          keeps its micro-batches, its targets, and its outputs.

        Examples
        --------
        >>> from skorch.callbacks import Callback, EpochScoring
        >>> from skorch.toy import make_classifier
        >>> from skorch_gradacc import GradAccNeuralNetClassifier
        >>> class PrintLoss(Callback):
        ...     train_batch_reads = ()  # reads only the history
        ...     def on_batch_end(self, net, **kwargs):
        ...         pass
        >>> net = GradAccNeuralNetClassifier(
        ...     make_classifier(), acc_steps=4, callbacks=[
        ...         PrintLoss(), EpochScoring('accuracy', on_train=True)])
        >>> net.initialize().get_train_outputs_needed()
        {'batch': False, 'y': True, 'y_pred': True}

        """
        if getattr(self, 'undeclared_reads_warned_', None) is None:
            self.undeclared_reads_warned_ = set()  # kept across fits
        reads, at_begin = train_batch_reads(
            self, getattr(self, 'callbacks_', []))
        batch = ('X' in reads or at_begin or self.micro_batch_size == 'auto'
                 or self._reevaluates_group())
        return {'batch': batch, 'y': 'y' in reads, 'y_pred': 'y_pred' in reads}

    def _reevaluates_group(self):
        """Whether a step may evaluate the group more than once.

        skorch passes the closure to each optimizer's ``step``: several
        optimizers, LBFGS or a step that is not ``torch.optim``'s (e.g.
        sharpness-aware) may call it again.
        """
        if len(self._optimizers) > 1:
            return True
        for name in self._optimizers:
            optimizer = getattr(self, name + '_', None)
            # a wrapper such as Accelerate's AcceleratedOptimizer
            while isinstance(getattr(optimizer, 'optimizer', None),
                             torch.optim.Optimizer):
                optimizer = optimizer.optimizer
            if optimizer is None:
                continue
            if isinstance(optimizer, torch.optim.LBFGS):
                return True
            step = getattr(type(optimizer), 'step', None)
            if not getattr(step, '__module__', '').startswith('torch.optim'):
                return True
        return False

    def _trains_in_groups(self):
        """Whether training needs the group loop; else it is plain skorch's."""
        return (self.get_acc_steps() != 1 or self.micro_batch_size is not None
                or self._decides_step() or self.mixed_precision is not None
                or isinstance(self.get_engine(), DataParallelEngine))

    def get_engine(self):
        """Return the engine of the module: what differs in a step.

        The engine (:mod:`skorch_gradacc.engine`) says which micro-batches
        this rank takes, the context of each backward, the sum over ranks
        and the end of the step. It is kept in ``engine_`` and made anew by
        :meth:`make_engine` for a new ``module_``.
        """
        engine = getattr(self, 'engine_', None)
        if engine is None or engine.module is not getattr(self, 'module_', None):
            engine = self.engine_ = self.make_engine()
        return engine

    def make_engine(self):
        """Return a new engine for ``module_``; see :meth:`get_engine`."""
        return engine_for(getattr(self, 'module_', None),
                          fp16=self.mixed_precision == 'fp16')

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run skorch's epoch; in training, over groups of micro-batches.

        The training iterator is wrapped in the engine's groups
        (:class:`~skorch_gradacc.grouping.MicroBatchGroups` in one process),
        one batch per optimizer step. A
        :class:`~torch.utils.data.DistributedSampler` gets ``set_epoch`` with
        the epoch's index from 0 (after a resume, the next one).
        """
        sampler = getattr(iterator, 'sampler', None)
        if training and isinstance(sampler, DistributedSampler):
            # the epoch's index from 0, as in PyTorch's loops; the epoch's
            # row is in the history already, that of a resumed run too
            sampler.set_epoch(max(len(self.history) - 1, 0))
        if training and iterator is not None and self._trains_in_groups():
            needed = self.get_train_outputs_needed()
            self._keep_train_y_pred_ = needed['y_pred']
            iterator = self.get_engine().groups(
                iterator, self.get_acc_steps(), keep=needed['batch'],
                keep_targets=needed['y'])
        return super().run_single_epoch(
            iterator, training, prefix, step_fn, **fit_params)

    # The step

    def train_step(self, batch, **fit_params):
        """Take one optimizer step on a group of micro-batches.

        skorch's ``train_step``, with the gradient of
        :meth:`accumulate_gradients`. An exception midway discards the
        partial gradient; the optimizers have not stepped.

        Returns
        -------
        step : dict
          ``{'loss': loss, 'y_pred': y_pred}`` for the whole group;
          ``y_pred`` is None unless a callback reads it
          (:meth:`get_train_outputs_needed`).

        """
        if not isinstance(batch, MicroBatchGroup):  # plain skorch's training
            return super().train_step(batch, **fit_params)
        # skorch's NeuralNet.train_step, except for the marked line
        step_accumulator = self.get_train_step_accumulator()

        def step_fn():
            self._zero_grad_optimizer()
            step = self.accumulate_gradients(batch, **fit_params)  # <= changed
            step_accumulator.store_step(step)

            self.notify(
                'on_grad_computed',
                named_parameters=TeeGenerator(self.get_all_learnable_params()),
                batch=batch,
                training=True,
            )
            return step['loss']

        try:
            self._step_optimizer(step_fn)
        except BaseException:
            # An error or Ctrl-C in the middle of the group: the optimizers
            # have not stepped, and the partial gradient must not survive.
            self._zero_grad_optimizer()
            raise
        return _as_skorch_step(step_accumulator.get_step())

    # Mixed precision, and whether a step is taken or skipped

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        """Nothing is skipped before a batch's step."""
        super().on_batch_begin(net, batch=batch, training=training, **kwargs)
        self._batch_step_skipped_ = False

    def on_batch_end(self, net, batch=None, training=False, **kwargs):
        """Report a skipped step, and a plan's measured peak, to the callbacks."""
        super().on_batch_end(net, batch=batch, training=training, **kwargs)
        record_measured_peak(self)
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

    def _get_grad_scaler(self):
        """Return the GradScaler of ``mixed_precision='fp16'``, else None."""
        if self.mixed_precision != 'fp16':
            return None
        if getattr(self, 'grad_scaler_', None) is None:
            self.grad_scaler_ = self.make_grad_scaler()
        return self.grad_scaler_

    def make_grad_scaler(self):
        """Return a new GradScaler for ``mixed_precision='fp16'``."""
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

    # Accumulation and normalization

    def count_loss_items(self, batch):
        """Return the number of items that a micro-batch's loss averages over.

        The gradients are weighted by these counts, which makes the update
        that of the mean over the group. By default, what the criterion
        divides by (:func:`~skorch_gradacc.counting.count_items`). Override
        it when the loss averages over something else.

        Parameters
        ----------
        batch
          A micro-batch ``(X, y)``.

        Returns
        -------
        count : int, float, one-element tensor, or None
          None for a loss that is a sum. A micro-batch with a count of 0
          adds nothing. A tensor is never read on the host.

        Examples
        --------
        Count the labeled tokens of a model that takes its labels in ``X``:

        >>> from skorch import NeuralNet
        >>> class TokenNet(GradAccMixin, NeuralNet):
        ...     def count_loss_items(self, batch):
        ...         X, _ = batch
        ...         return (X['labels'] != -100).sum()

        """
        return count_items(
            [getattr(self, name + '_', None) for name in self._criteria], batch)

    def accumulate_gradients(self, group, **fit_params):
        """Compute the gradient of a whole group, one micro-batch at a time.

        The one loop of every engine. Runs ``train_step_single`` on each
        micro-batch of ``group`` (or its pieces of ``micro_batch_size``
        rows); the loss of piece ``j`` leaves ``get_loss`` with its value
        and the gradient of the loss times ``c_j / u`` (``c_j``: its
        :meth:`count_loss_items`; ``u``: the unit of
        :class:`~skorch_gradacc.counting.ItemCounts`). The engine's
        ``end_step`` divides by the total count once.

        Parameters
        ----------
        group : skorch_gradacc.grouping.MicroBatchGroup
          The micro-batches of one step.

        **fit_params : dict
          Additional parameters passed to ``train_step_single``.

        Returns
        -------
        step : dict
          ``{'loss': loss, 'y_pred': y_pred}``: the mean loss over the group
          and, if a callback reads them, the module's outputs for all of its
          rows, both detached; else ``y_pred`` is None.

        """
        auto = self.micro_batch_size == 'auto'
        buffers = snapshot_buffers(self) if auto else None
        if auto and self.memory_plan_ is None:
            plan_memory(self, group, buffers, **fit_params)
        while True:
            self._piece_records_ = []
            try:
                step = self._accumulate_gradients(group, **fit_params)
            except Exception as error:
                if not (auto and backs_off(error)):
                    raise
                size = getattr(error, 'micro_batch_size', None)
            else:
                self._merge_piece_records()
                return step
            # outside the except block, so that the failed attempt's
            # tensors, held by the traceback, are freed
            self.get_engine().discard_gradient(functools.partial(
                self._train_piece, counts=_NO_ITEMS, is_last=True,
                **fit_params))
            back_off(self, group, buffers, size)

    def _accumulate_gradients(self, group, **fit_params):
        engine = self.get_engine()
        keep_y_pred = getattr(self, '_keep_train_y_pred_', False)
        y_preds = []
        counts = ItemCounts(count_unit=engine.count_unit,
                            name='count_loss_items(batch)',
                            share=engine.share_count_unit)
        for piece, is_last in engine.passes(self._pieces(group)):
            if not counts.add(self.count_loss_items(piece),
                              skippable=engine.may_skip(is_last)):
                # no item: adds nothing to the mean that the large batch takes
                if keep_y_pred:
                    y_preds.append(self._infer_without_grad(
                        piece, **fit_params))
                del piece
                continue
            if is_last:
                engine.set_count_unit(None if counts.summed else (
                    0.0 if counts.count_unit is None else counts.count_unit))
            try:
                step = self._train_piece(piece, counts, is_last, **fit_params)
            except Exception as error:
                if self.micro_batch_size == 'auto' and is_out_of_memory(error):
                    error.in_pass = True
                    # the other ranks run this pass's collectives, and learn
                    # of the error: so must this one
                    engine.after_error(functools.partial(
                        self._train_piece, counts=_NO_ITEMS, is_last=is_last,
                        **fit_params), backed_off_size(group))
                raise
            counts.add_loss(step['loss'].detach())
            if keep_y_pred and batch_len(piece):
                y_preds.append(detach_outputs(step['y_pred']))
            del step, piece  # frees the piece's graph and outputs
        loss = engine.end_step(self, group, counts)
        self._unscale_gradients()  # callbacks see true gradients
        return {'loss': loss,
                'y_pred': concat_outputs(y_preds) if y_preds else None}

    def _pieces(self, group):
        """Yield ``(piece, is_last)`` for the pieces of ``group``.

        A piece is a micro-batch, or a slice of ``micro_batch_size`` rows
        (with a memory plan, of its cost).
        """
        for index, micro in enumerate(group.micro_batches()):
            pieces = split_micro_batch(self, micro, group)
            del micro  # held by pieces until the next one is pulled
            last = len(pieces) - 1
            for number in range(len(pieces)):
                yield pieces[number], number == last and group.is_last(index)
            del pieces

    def _check_loss_on(self, piece, **fit_params):
        """Check the loss on ``piece`` while a check is pending (``check_loss``)."""
        if getattr(self, 'loss_check_pending_', 0):
            checked = check_loss_is_mean(self, piece, **fit_params)
            if checked is not None:  # a try: three forward passes
                self.loss_check_pending_ = (
                    0 if checked else self.loss_check_pending_ - 1)

    def _train_piece(self, piece, counts, is_last, **fit_params):
        """Run ``train_step_single`` on one piece, weighted by its count.

        In the engine's context and under :meth:`autocast`. ``get_loss`` is
        replaced on the instance for the call, so that overrides of
        ``train_step_single`` keep working (skorch has no loss hook). A
        piece without items (weight 0) gets a zero gradient through its
        outputs. Values recorded in the history row are noted for
        :meth:`_merge_piece_records`.
        """
        self._check_loss_on(piece, **fit_params)
        row = self._current_batch_row()
        before = dict(row) if row is not None else None
        weight, scaler, calls = counts.weight, self._get_grad_scaler(), []
        # a train_step_single that computed its loss without get_loss on an
        # earlier piece: in one process, .grad is rescaled around it instead
        rescale = (getattr(counts, 'without_get_loss', False)
                   and type(self.get_engine()) is Engine
                   and isinstance(weight, float) and weight not in (0, 1))
        if rescale:
            scale_gradients(learnable_gradients(self), 1 / weight)
            weight = 1.0
        get_loss = self.get_loss

        def weighted_loss(y_pred, y_true, X=None, training=False):
            loss = get_loss(y_pred, y_true, X=X, training=training)
            if training:
                calls.append(True)
                loss = _weighted(loss, y_pred, weight, scaler)
            return loss

        own = vars(self).get('get_loss')  # e.g. a test's mock
        self.get_loss = weighted_loss  # what train_step_single calls
        try:
            with self.get_engine().context(is_last), self.autocast():
                step = self.train_step_single(piece, **fit_params)
        finally:
            del self.get_loss
            if own is not None:
                self.get_loss = own
        if rescale:
            scale_gradients(learnable_gradients(self), counts.weight)
        if not calls:
            if (scaler is not None or isinstance(weight, torch.Tensor)
                    or weight not in (None, 1)):
                raise RuntimeError(
                    "GradAccMixin weights each micro-batch's loss (and, with "
                    "mixed_precision='fp16', scales it) as it leaves get_loss; "
                    "an override of train_step_single must compute the loss "
                    "with self.get_loss(..., training=True).")
            counts.without_get_loss = True  # the next pieces rescale .grad
        if row is not None and self._piece_records_ is not None:
            self._piece_records_.append((counts.count, {
                key: value for key, value in row.items()
                if key not in before or before[key] is not value}))
        return step

    def _current_batch_row(self):
        try:
            return self.history[-1]['batches'][-1]
        except (IndexError, KeyError):  # a step outside skorch's epoch loop
            return None

    def _merge_piece_records(self):
        """Give the batch row the values the large batch would have recorded.

        A float recorded by several pieces (a loss term, say) is combined as
        the loss is, by :func:`~skorch_gradacc.counting.weighted_mean`; other
        values keep the last piece's.
        """
        records, self._piece_records_ = self._piece_records_, []
        row = self._current_batch_row()
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

    def _infer_without_grad(self, batch, **fit_params):
        self._set_training(True)
        # X is the first member, also of batches with more than (X, y)
        Xi = batch[0] if isinstance(batch, (tuple, list)) else batch
        with torch.no_grad(), self.autocast():
            return self.infer(Xi, **fit_params)

    # micro_batch_size='auto'

    def on_epoch_end(self, net, **kwargs):
        """Record the epoch's micro-batch size and skipped steps, if used."""
        super().on_epoch_end(net, **kwargs)
        self._batch_step_skipped_ = False  # epoch-level schedulers step
        if self.micro_batch_size == 'auto':
            # in every epoch's row, so that PrintLog's columns stay aligned;
            # 0 while whole micro-batches fit
            self.history.record('micro_batch_size', self.micro_batch_size_ or 0)
        if self._decides_step():
            skipped = sum(row.get('step_skipped', False)
                          for row in self.history[-1, 'batches'])
            self.history.record('skipped_steps', skipped)

    # Validation and prediction with micro_batch_size

    def eval_pieces(self, batch):
        """Return the pieces of a validation or prediction batch, or None.

        Pieces of ``micro_batch_size`` rows; None (the batch as it is)
        without ``micro_batch_size`` or for a batch that fits.
        """
        size = self.get_micro_batch_size()
        if size is None or batch_len(batch) <= size:
            return None
        return split_batch(batch, size)

    def validation_step(self, batch, **fit_params):
        """Run skorch's validation step, in pieces if ``micro_batch_size`` is set.

        The loss is then the mean over the batch, weighted by
        :meth:`count_loss_items` as in training, and ``y_pred`` holds the
        outputs for all rows.

        """
        pieces = self.eval_pieces(batch)
        if pieces is None:
            return super().validation_step(batch, **fit_params)
        steps = []
        counts = ItemCounts(name='count_loss_items(batch)')  # weighs losses
        for piece in pieces:
            counts.add(self.count_loss_items(piece))
            steps.append(super(GradAccMixin, self).validation_step(
                piece, **fit_params))
            counts.add_loss(steps[-1]['loss'])
        return {'loss': counts.loss(),
                'y_pred': concat_outputs([step['y_pred'] for step in steps])}

    def evaluation_step(self, batch, training=False):
        """Run skorch's evaluation step, in pieces if ``micro_batch_size`` is set."""
        pieces = self.eval_pieces(batch)
        if pieces is None:
            return super().evaluation_step(batch, training=training)
        return concat_outputs([
            super(GradAccMixin, self).evaluation_step(piece, training=training)
            for piece in pieces])


def grad_acc_params_doc():
    """Return the Parameters section of :class:`GradAccMixin`'s docstring.

    The net classes add it to their own docstrings, so that the parameters
    are documented in one place.
    """
    doc = inspect.getdoc(GradAccMixin)
    start = doc.index('Parameters\n----------')
    end = doc.index('Attributes\n----------')
    section = doc[start:end].rstrip()
    return '\n' + '\n'.join(
        '    ' + line if line else line for line in section.splitlines()) + '\n'


def _as_skorch_step(step):
    """Return the step with a loss that requires grad, as skorch's does.

    skorch's ``train_step`` returns the loss of the graph it trained on, so
    callbacks see ``loss.requires_grad`` in training. The group's loss is
    a sum of detached losses (their graphs are freed after each backward),
    so it is made a leaf that requires grad: no graph is kept.
    """
    loss = step.get('loss') if isinstance(step, dict) else None
    if (isinstance(loss, torch.Tensor) and loss.is_floating_point()
            and not loss.requires_grad):
        step = dict(step, loss=loss.detach().requires_grad_())
    return step


# the counts of a zero-row pass that stands in for a failed one
_NO_ITEMS = types.SimpleNamespace(count=0.0, weight=0.0)


def _weighted(loss, y_pred, weight, scaler):
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


def _is_float(value):
    """Whether ``value`` is a float scalar: Python, numpy, or a 0-d tensor."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and value.dtype.is_floating_point
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and np.issubdtype(value.dtype, np.floating)
    return isinstance(value, (float, np.floating))


def _combined_signature(cls):
    """Return the signature of ``cls.__init__`` as the classes define it.

    Walks the MRO: the keyword-only parameters of each mixin, whose
    ``__init__`` takes ``(self, *args, ..., **kwargs)`` (GradAccMixin,
    skorch's AccelerateMixin, ...), are added to the parameters of the
    first ``__init__`` that names its own first parameter: the net class
    being extended.
    """
    mixin_params, extended = [], None
    for klass in cls.__mro__[1:]:
        init = vars(klass).get('__init__')
        if init is None or getattr(init, '_generated_by_grad_acc', False):
            continue
        params = list(inspect.signature(init).parameters.values())
        if params[1].kind == params[1].VAR_POSITIONAL:  # (self, *args, ...)
            mixin_params.extend(param for param in params
                                if param.kind == param.KEYWORD_ONLY)
            continue
        extended = inspect.signature(init)
        break
    params = [param for param in extended.parameters.values()
              if param.kind != param.VAR_KEYWORD]
    names = {param.name for param in params}
    params.extend(param for param in mixin_params if param.name not in names)
    params.extend(param for param in extended.parameters.values()
                  if param.kind == param.VAR_KEYWORD)
    return extended.replace(parameters=params)
