"""The mixin that gives a skorch net exact gradient accumulation.

Where things happen, in one place each:

* the groups of ``acc_steps`` micro-batches, pulled one at a time from the
  user's training iterator: :meth:`GradAccMixin.run_single_epoch` and
  :mod:`skorch_gradacc.grouping`;
* the optimizer step, once per group: :meth:`GradAccMixin.train_step`;
* forward and backward on each micro-batch, and the normalization of the
  summed gradient: :meth:`GradAccMixin.accumulate_gradients`;
* what a micro-batch's loss is averaged over:
  :meth:`GradAccMixin.count_loss_items`;
* what is kept of a group for callbacks:
  :meth:`GradAccMixin.get_train_outputs_needed`;
* the rows per forward pass (``micro_batch_size``, the 'auto' back-off):
  :meth:`GradAccMixin.get_micro_batch_size` and
  :meth:`GradAccMixin.accumulate_gradients`;
* autocast, loss scaling and whether a step is skipped (``mixed_precision``,
  ``skip_nonfinite``): :mod:`skorch_gradacc.precision`;
* what differs between one process, DDP and FSDP2 (which micro-batches a
  rank takes, the context of each backward, the sum over ranks, the end of
  the step): the net's engine, :meth:`GradAccMixin.get_engine` and
  :mod:`skorch_gradacc.engine`.
"""

import functools
import inspect
import math
import sys
import types

import numpy as np
import torch
from skorch.callbacks import ProgressBar
from skorch.utils import TeeGenerator
from torch.utils.data import DistributedSampler

from skorch_gradacc.batch_reads import callback_reads, warn_undeclared_reads
from skorch_gradacc.batching import (
    batch_len,
    concat_outputs,
    detach_outputs,
    is_positive_int,
    split_batch,
)
from skorch_gradacc.engine import (
    DataParallelEngine,
    Engine,
    engine_for,
    learnable_gradients,
)
from skorch_gradacc.grouping import MicroBatchGroup
from skorch_gradacc.item_counts import ItemCounts, scale_gradients
from skorch_gradacc.loss_items import check_loss_is_mean, count_items
from skorch_gradacc.precision import AUTOCAST_DTYPES, StepDecisionMixin

__all__ = ['GradAccMixin']

# the micro-batches the loss check tries before it gives up undecided
LOSS_CHECK_TRIES = 3


class GradAccMixin(StepDecisionMixin):
    """Mixin class that adds exact gradient accumulation to a skorch net.

    Use it with one of skorch's net classes, e.g. ``class
    MyNet(GradAccMixin, NeuralNetClassifier)``, or use one of the ready-made
    classes such as :class:`skorch_gradacc.GradAccNeuralNetClassifier`.

    With ``acc_steps=k``, the net takes one optimizer step per group of
    ``k`` consecutive micro-batches of its training iterator, which is
    skorch's, exactly as configured (``batch_size``, a sampler or batch
    sampler, ``collate_fn``, an ``IterableDataset``). Training is that of
    plain skorch on the unions of those micro-batches, e.g. with
    ``batch_size=B * k``: the same parameters, the same training history (one
    row per optimizer step), and training callbacks called once per step.
    Validation runs at ``batch_size``; the docs' compatibility page says what
    cannot match the large batch.

    How this is achieved:

    * skorch's epoch loop gets one batch per group, a
      :class:`~skorch_gradacc.grouping.MicroBatchGroup`, which pulls its
      micro-batches from the training iterator one at a time while
      :meth:`train_step` trains on them. The micro-batches left when the
      iterator ends are the final, partial group of the epoch, stepped
      like any other, before validation; nothing carries over into the next
      epoch.
    * :meth:`accumulate_gradients` runs ``train_step_single`` (forward and
      ``backward``) on each micro-batch. The gradients add up, each
      weighted by the number of items its micro-batch's loss averages over
      (see :meth:`count_loss_items`), and are divided by the group's total
      once, so a short micro-batch or a partial group is weighted exactly
      as in the large batch's mean. A criterion with ``reduction='sum'`` is
      not weighted at all. The loss's value is never touched.
    * ``on_grad_computed`` is notified once per step with the whole,
      normalized gradient, then all optimizers step once. The reported
      ``loss`` is the group's mean loss, never a divided one.
    * A micro-batch's outputs are freed after its backward, unless a
      callback reads them (see :meth:`get_train_outputs_needed`).

    With ``acc_steps=1`` and none of the other options, training is plain
    skorch's. Validation and prediction run at ``batch_size``, untouched,
    unless ``micro_batch_size`` is set: then they are split as well.

    Parameters
    ----------
    acc_steps : int (default=1)
      The number of consecutive micro-batches of the training iterator whose
      gradients are accumulated into each optimizer step. ``acc_steps=1``
      is plain skorch. Larger values than the number of micro-batches in an
      epoch are allowed and give one step per epoch.

    micro_batch_size : int, 'auto' or None (default=None)
      Split each micro-batch of the training iterator, and each validation
      and prediction batch, into pieces of at most this many rows for the
      forward pass. The effective batch is unchanged: everything that sees
      batches (history, callbacks) sees the same batches. With ``'auto'``,
      the net starts with whole micro-batches and, on an out-of-memory
      error, frees what the attempt held, restores the modules' buffers
      (e.g. BatchNorm's running statistics), halves the pieces and replays
      the group, so the update equals the one without the error (not
      restored: the random number generator's state, e.g. dropout draws
      made before the error, and attributes a module sets on itself). To
      replay it, the net keeps the current group's micro-batches as the
      iterator yielded them until its step is done. The size that worked is kept in
      ``micro_batch_size_``. The sizes a batch backed off to are listed in
      its history row as ``micro_batch_size_backoff``; every epoch's row
      holds the ``micro_batch_size`` in use at its end (0 while whole
      micro-batches fit).

    skip_nonfinite : bool (default=False)
      If True, a step whose accumulated gradient holds inf or NaN is
      skipped: parameters and optimizer state stay unchanged, the gradient
      is zeroed, per-batch learning-rate schedulers do not advance, the
      batch's history row gets ``step_skipped=True``, and the epoch's row
      counts ``skipped_steps``. Training goes on. If False, the step is
      taken, as in plain skorch.

    mixed_precision : None, 'bf16' or 'fp16' (default=None)
      Run each micro-batch's forward pass and loss under
      :class:`torch.autocast` with this dtype. With ``'fp16'``, a
      :class:`torch.amp.GradScaler` scales every micro-batch's loss for
      ``backward``, unscales the gradient once per group before
      ``on_grad_computed`` (so clipping sees true gradients), and steps and
      updates once per group; a step it skips does not advance per-batch
      learning-rate schedulers and is counted as with ``skip_nonfinite``.
      The reported loss is never the scaled one. Validation and prediction
      run in full precision.

    check_loss : bool (default=True)
      Check once per fit, on the first micro-batch of two rows or more, that
      the loss is a mean over what :meth:`count_loss_items` counts (or a
      sum, if it returns None): the loss of the micro-batch must equal the
      count-weighted mean of the losses of its halves. If not, a
      :class:`~skorch_gradacc.LossItemsWarning` says by how much. The check
      costs three forward passes (the micro-batch and its halves), in eval
      mode and without gradient; the modules' buffers and the random number
      generators are left as they were. If they cannot decide (a loss that
      is not finite, a micro-batch without items), it tries the next
      micro-batch, 3 at most: 9 forward passes at most per fit. It is
      skipped in multi-process training and for batches that are not
      ``(X, y)``.

    Attributes
    ----------
    micro_batch_size_ : int or None
      With ``micro_batch_size='auto'``, the size found to fit; None while
      whole micro-batches fit.

    grad_scaler_ : torch.amp.GradScaler or None
      The GradScaler of ``mixed_precision='fp16'``.

    engine_ : skorch_gradacc.engine.Engine
      What the step of this net's module needs of its engine (one
      process, DDP, FSDP2), set at the first step; see :meth:`get_engine`.

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

    # The parameters are the keyword-only parameters of this __init__; the
    # signature that scikit-learn reads is built from it (see
    # __init_subclass__).
    def __init__(self, *args, acc_steps=1, micro_batch_size=None,
                 skip_nonfinite=False, mixed_precision=None, check_loss=True,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps
        self.micro_batch_size = micro_batch_size
        self.skip_nonfinite = skip_nonfinite
        self.mixed_precision = mixed_precision
        self.check_loss = check_loss

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
        if not is_positive_int(self.acc_steps):
            raise ValueError(
                "acc_steps must be a positive integer, got {!r} instead."
                .format(self.acc_steps))
        micro_batch_size = self.micro_batch_size
        if not (micro_batch_size is None or micro_batch_size == 'auto'
                or is_positive_int(micro_batch_size)):
            raise ValueError(
                "micro_batch_size must be None, 'auto' or a positive integer, "
                "got {!r} instead.".format(micro_batch_size))
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

        The callbacks are skorch's, initialized in place: the objects in
        ``callbacks`` are the ones in ``callbacks_``. A class attribute
        ``train_batch_reads`` that is not a collection of ``'X'``, ``'y'``
        and ``'y_pred'`` raises a ValueError here, before any training (see
        :meth:`get_train_outputs_needed`).

        """
        super().initialize_callbacks()
        for _, cb in self.callbacks_:
            callback_reads(self, cb)
        return self

    def notify(self, method_name, **cb_kwargs):
        """Call the callbacks, as skorch does.

        After ``on_epoch_begin``, a :class:`skorch.callbacks.ProgressBar` with
        ``batches_per_epoch='auto'`` is told the epoch's number of optimizer
        steps, which is its number of training batches: skorch's bar counts
        ``batch_size`` rows per training batch, a GradAcc net's training
        batch is a group of ``acc_steps`` micro-batches.

        """
        super().notify(method_name, **cb_kwargs)
        if method_name == 'on_epoch_begin':
            self._count_steps_in_progress_bars(cb_kwargs.get('dataset_train'))

    def _count_steps_in_progress_bars(self, dataset_train):
        acc_steps = self.get_acc_steps()
        if dataset_train is None or acc_steps == 1:
            return
        for _, cb in self.callbacks_:
            if not (isinstance(cb, ProgressBar)
                    and cb.batches_per_epoch == 'auto'):
                continue
            pbar = getattr(cb, 'pbar_', None)
            if pbar is None or pbar.total is None:
                continue
            # the bar counted micro-batches of batch_size rows
            micro = cb._get_batches_per_epoch_phase(self, dataset_train, True)
            if micro > 0:
                pbar.total += math.ceil(micro / acc_steps) - micro

    def initialize(self):
        """Initialize the net; ``micro_batch_size='auto'`` starts afresh."""
        self.micro_batch_size_ = None
        self.grad_scaler_ = None
        return super().initialize()

    # Batch sizes and acc_steps in force

    def get_micro_batch_size(self):
        """Return the most rows that go through the module at once in training.

        That is ``micro_batch_size`` if it is an integer, the size found so far
        if it is ``'auto'`` and ``None`` (whole micro-batches) otherwise.

        """
        if self.micro_batch_size == 'auto':
            return getattr(self, 'micro_batch_size_', None)
        return self.micro_batch_size

    def get_acc_steps(self):
        """Return the ``acc_steps`` in force for the current epoch.

        That is ``acc_steps``, unless an
        :class:`~skorch_gradacc.AccumulationScheduler` has set another value
        for this epoch (in ``acc_steps_``).

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

        skorch passes each training batch to the callbacks as ``batch``
        (``on_batch_begin``, ``on_grad_computed``, ``on_batch_end``) and its
        outputs as ``y_pred`` (``on_batch_end``). A GradAcc net's batch is a
        group of micro-batches, each freed after its backward pass unless a
        callback reads it. Then the callbacks get what the large-batch net
        passes them: the whole group's rows and outputs.

        * skorch's own callbacks are known: an
          :class:`~skorch.callbacks.EpochScoring` with ``on_train=True`` that
          caches (its ``use_caching``, or the net's if not ``'auto'``) reads
          the targets and the outputs, a
          :class:`~skorch.callbacks.BatchScoring` with ``on_train=True`` the
          inputs and targets, and the outputs if it caches. The others read
          none of them.
        * A callback of your own that overrides ``on_batch_begin``,
          ``on_grad_computed`` or ``on_batch_end`` is taken to read all of
          them, unless its class declares what it reads in the attribute
          ``train_batch_reads``: a collection of ``'X'`` (inputs), ``'y'``
          (targets) and ``'y_pred'`` (outputs), or ``()`` for none of them.
          For example, a callback that logs the running loss from the
          history declares ``train_batch_reads = ()``. For a callback that
          declares nothing, the net warns once that it keeps the group.

        The memory this costs, until the group's step is done: the group's
        micro-batches as the iterator yielded them (``'X'``, or ``'y'`` read
        in ``on_batch_begin``), the group's targets (``'y'``), or its
        outputs, detached (``'y_pred'``); never activations. The inputs are
        also kept for an optimizer that evaluates the group more than once
        (LBFGS, several optimizers, an optimizer whose ``step`` is not
        ``torch.optim``'s own, such as a sharpness-aware one) and with
        ``micro_batch_size='auto'``, which replays a group after an
        out-of-memory error. With nothing read, ``y_pred`` is None, and the
        net holds one micro-batch at a time.

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
        reads, at_begin = set(), False
        warn_undeclared_reads(self, getattr(self, 'callbacks_', []))
        for _, cb in getattr(self, 'callbacks_', []):
            cb_reads, cb_at_begin = callback_reads(self, cb)
            reads |= cb_reads
            at_begin |= cb_at_begin
        batch = ('X' in reads or at_begin or self.micro_batch_size == 'auto'
                 or self._reevaluates_group())
        return {'batch': batch, 'y': 'y' in reads, 'y_pred': 'y_pred' in reads}

    def _reevaluates_group(self):
        """Whether a step may evaluate the group more than once.

        skorch passes the closure to each optimizer's ``step``, so with
        several optimizers, or LBFGS, the group is evaluated again. So may
        an optimizer whose ``step`` is not one of ``torch.optim``'s, e.g. a
        sharpness-aware one, which evaluates the closure twice.
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
        this rank takes, the context of each backward, how the gradients
        are summed over ranks and how the step ends. It is kept in
        ``engine_``, and made anew for a new ``module_``: a
        :class:`~skorch_gradacc.engine.DDPEngine` for a module wrapped in
        DistributedDataParallel (by
        :class:`~skorch_gradacc.DistributedGradAccMixin` or by skorch's
        ``AccelerateMixin``), else the single process's. An engine's mixin
        overrides :meth:`make_engine`.
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
        so that skorch's loop, history and callbacks see one batch per
        optimizer step. A training iterator's
        :class:`~torch.utils.data.DistributedSampler` gets ``set_epoch``
        with the epoch's index from 0 (after a resume, the next one).

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

        This is skorch's ``train_step``, except that the gradient is computed
        by :meth:`accumulate_gradients`, one micro-batch at a time. The
        optimizers are zeroed once and step once per group, and
        ``on_grad_computed`` is notified once, with the normalized gradient
        of the group. Closure optimizers such as LBFGS re-evaluate the whole
        group whenever they call the closure.

        If an exception or ``KeyboardInterrupt`` stops the group midway, the
        optimizers have not stepped, so parameters and optimizer state are
        those of the last completed step, and the partial gradient is
        discarded before the exception propagates.

        Returns
        -------
        step : dict
          ``{'loss': loss, 'y_pred': y_pred}`` for the whole group.
          ``y_pred`` is detached, and None unless a callback reads it (see
          :meth:`get_train_outputs_needed`). ``loss`` holds no graph but
          requires grad, as the loss skorch's ``train_step`` returns.

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

    # Accumulation and normalization

    def count_loss_items(self, batch):
        """Return the number of items that a micro-batch's loss averages over.

        The gradients of the micro-batches are weighted by these counts and
        divided by their sum, which makes the update that of the mean over
        the whole group. By default, what torch's criterion divides by
        (:func:`skorch_gradacc.loss_items.count_items`): for
        :class:`torch.nn.CrossEntropyLoss` and :class:`torch.nn.NLLLoss`,
        the targets ``y`` that are not ``ignore_index``, weighted by the
        class ``weight`` if set; for element-wise losses such as
        :class:`torch.nn.MSELoss`, the elements of ``y``; the samples for
        other criteria. Override it when the loss averages over something
        else, e.g. tokens whose labels live in ``X``.

        Parameters
        ----------
        batch
          A micro-batch ``(X, y)``.

        Returns
        -------
        count : int, float, one-element tensor, or None
          ``None`` means that the loss is a sum, not a mean (the default
          when the criterion has ``reduction='sum'``), and is accumulated
          without any rescaling. A micro-batch with a count of 0 adds
          nothing to the group's gradient; a group whose counts are all 0
          is stepped with the gradient its loss gives (zero for
          :class:`torch.nn.CrossEntropyLoss` with every target ignored), as
          the large-batch net does. A tensor, e.g. ``(y != -100).sum()`` on
          the GPU, is never read on the host, so that counting does not
          wait for the device; then every micro-batch's backward runs, and
          one with a count of 0 must have a zero gradient, as
          :class:`torch.nn.CrossEntropyLoss` with every target ignored has.

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

        The one loop of every engine (:meth:`get_engine`). Runs
        ``train_step_single`` (forward and backward) on each micro-batch of
        ``group``, or on pieces of ``micro_batch_size`` rows, in the passes
        and backward contexts of the engine. The backward of piece ``j``
        computes the gradient of its loss times ``c_j / u``: ``c_j`` is its
        item count (:meth:`count_loss_items`), ``u`` the unit (the first
        positive count; see :class:`~skorch_gradacc.item_counts.ItemCounts`),
        applied as the loss leaves ``get_loss``; its value is untouched. The
        engine's :meth:`~skorch_gradacc.engine.Engine.end_step` divides once
        by the step's total count. The result is the gradient of the mean
        loss over all items of the group (on all ranks), while one
        micro-batch is held at a time. Overridden ``train_step_single`` and
        ``get_loss`` methods are used as they are, as long as the loss
        comes from ``get_loss``.

        With ``micro_batch_size='auto'``, an out-of-memory error (on any
        rank) zeroes the gradient, restores the modules' buffers, halves the
        pieces and starts the group again.

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
        buffers = self._snapshot_buffers()
        while True:
            self._piece_records_ = []
            try:
                step = self._accumulate_gradients(group, **fit_params)
            except _OUT_OF_MEMORY_ERRORS as error:
                if self.micro_batch_size != 'auto':
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
            self._back_off_micro_batch_size(group, buffers, size)

    def _accumulate_gradients(self, group, **fit_params):
        engine = self.get_engine()
        keep_y_pred = getattr(self, '_keep_train_y_pred_', False)
        y_preds = []
        counts = ItemCounts(unit=engine.unit, name='count_loss_items(batch)',
                            share=engine.share_unit)
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
                engine.set_unit(None if counts.summed else (
                    0.0 if counts.unit is None else counts.unit))
            try:
                step = self._train_piece(piece, counts, is_last, **fit_params)
            except _OUT_OF_MEMORY_ERRORS:
                if self.micro_batch_size == 'auto':
                    # the other ranks run this pass's collectives, and learn
                    # of the error: so must this one
                    engine.after_error(functools.partial(
                        self._train_piece, counts=_NO_ITEMS, is_last=is_last,
                        **fit_params), self._backed_off_size(group))
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
        """Yield ``(piece, is_last)`` for the micro-batches of ``group``.

        A piece is a micro-batch, or a part of ``micro_batch_size`` rows.
        """
        size = self.get_micro_batch_size()
        for index, micro in enumerate(group.micro_batches()):
            group.rows_in_flight = batch_len(micro)
            pieces = ([micro] if size is None or group.rows_in_flight <= size
                      else split_batch(micro, size))
            del micro  # held by pieces until the next one is pulled
            last = len(pieces) - 1
            for number in range(len(pieces)):
                yield pieces[number], number == last and group.is_last(index)
            del pieces

    def _train_piece(self, piece, counts, is_last, **fit_params):
        """Run ``train_step_single`` on one piece, weighted by its count.

        Runs in the engine's context and, with ``mixed_precision``, under
        autocast. The training loss that ``train_step_single`` gets from
        ``get_loss`` (overrides included) has the value of the loss, while
        ``backward`` computes the gradient of the loss times the piece's
        weight ``c / u`` (see :meth:`accumulate_gradients`), and with
        ``mixed_precision='fp16'`` times the GradScaler's scale. A piece
        without items (weight 0) gets a zero gradient through its outputs,
        never through its loss, which may be NaN.

        Values that ``train_step_single``, ``get_loss`` or ``infer`` record
        in the batch's history row are noted with the piece's item count,
        and combined by :meth:`_merge_piece_records` once the group is done.
        """
        if getattr(self, 'loss_check_pending_', 0):
            checked = check_loss_is_mean(self, piece, **fit_params)
            if checked is not None:  # a try: three forward passes
                self.loss_check_pending_ = (
                    0 if checked else self.loss_check_pending_ - 1)
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
            with self.get_engine().context(is_last), self._autocast():
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

        A float that several pieces recorded under the same key (say, one
        term of a loss, recorded in ``get_loss``) is combined as the loss
        is: the mean weighted by :meth:`count_loss_items`, or the sum when
        the loss is a sum. Other values keep the last piece's.
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
            # counts are all None (summed losses) or all numbers; an
            # item-less piece's value (a mean of nothing) is left out
            counted = [(count, value) for count, value in pairs if count]
            if pairs[0][0] is None:
                row[key] = sum(value for _, value in pairs)
            elif counted:
                row[key] = (sum(count * value for count, value in counted)
                            / sum(count for count, _ in counted))

    def _infer_without_grad(self, batch, **fit_params):
        self._set_training(True)
        # X is the first member, also of batches with more than (X, y)
        Xi = batch[0] if isinstance(batch, (tuple, list)) else batch
        with torch.no_grad(), self._autocast():
            return self.infer(Xi, **fit_params)

    # micro_batch_size='auto'

    def _snapshot_buffers(self):
        """Copy the modules' buffers, for a retry after an out-of-memory error."""
        if self.micro_batch_size != 'auto':
            return None
        return [(buffer, buffer.detach().clone())
                for name in self._modules + self._criteria
                if isinstance(getattr(self, name + '_', None), torch.nn.Module)
                for buffer in getattr(self, name + '_').buffers()]

    def _backed_off_size(self, group):
        """Return half the rows of the piece that ran out of memory."""
        rows = group.rows_in_flight
        current = min(self.micro_batch_size_ or rows, rows)
        if current <= 1:
            raise RuntimeError(
                "micro_batch_size='auto': a micro-batch of one row does not fit "
                "in memory; use a smaller model or less data per row.")
        return (current + 1) // 2

    def _back_off_micro_batch_size(self, group, buffers, size=None):
        """Halve the pieces after an out-of-memory error and start again.

        As if the error had not happened: no gradient, and the modules'
        buffers as they were before the group. ``size``: the size that all
        ranks agreed on, if another rank ran out of memory.
        """
        self._zero_grad_optimizer()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.micro_batch_size_ = size or self._backed_off_size(group)
        # each back-off once, in the row of the batch that backed off
        row = self.history[-1]['batches'][-1]
        row['micro_batch_size_backoff'] = row.get(
            'micro_batch_size_backoff', []) + [self.micro_batch_size_]

    def on_epoch_end(self, net, **kwargs):
        """Record the epoch's micro-batch size and skipped steps, if used."""
        super().on_epoch_end(net, **kwargs)
        if self.micro_batch_size == 'auto':
            # in every epoch's row, so that PrintLog's columns stay aligned;
            # 0 while whole micro-batches fit
            self.history.record('micro_batch_size', self.micro_batch_size_ or 0)
        if self._decides_step():
            skipped = sum(row.get('step_skipped', False)
                          for row in self.history[-1, 'batches'])
            self.history.record('skipped_steps', skipped)

    # Validation and prediction with micro_batch_size

    def _eval_pieces(self, batch):
        """Split ``batch`` for validation or prediction, or return None.

        Only with ``micro_batch_size`` set do validation and prediction
        batches go through the module in pieces.

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
        pieces = self._eval_pieces(batch)
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
        pieces = self._eval_pieces(batch)
        if pieces is None:
            return super().evaluation_step(batch, training=training)
        return concat_outputs([
            super(GradAccMixin, self).evaluation_step(piece, training=training)
            for piece in pieces])


_OUT_OF_MEMORY_ERRORS = (torch.cuda.OutOfMemoryError,) + (
    (torch.OutOfMemoryError,) if hasattr(torch, 'OutOfMemoryError') else ())


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
        weighted = sum(0 * out.sum() for out in _tensors(y_pred))
    else:
        weighted = base if weight in (None, 1) else base * weight
    if scaler is not None:
        weighted = scaler.scale(weighted)
    if weighted is loss:
        return loss  # nothing to weight or scale
    # the value of the loss, the gradient of the weighted one
    return loss.detach() + (weighted - weighted.detach()).to(loss.dtype)


def _tensors(output):
    """Yield the tensors of a module output (a tensor or a nest of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, dict):
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _tensors(value)


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
