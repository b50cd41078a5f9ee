"""The mixin that gives a skorch net exact gradient accumulation.

Where things happen, in one place each:

* the group of ``acc_steps`` micro-batches is one batch of the training
  iterator: :meth:`GradAccMixin.get_iterator`;
* the optimizer step, once per group: :meth:`GradAccMixin.train_step`;
* forward and backward on each micro-batch, and the normalisation of the
  summed gradient: :meth:`GradAccMixin.accumulate_gradients`;
* what a micro-batch's loss is averaged over:
  :meth:`GradAccMixin.count_loss_items`;
* the rows per forward pass (``micro_batch_size``, the 'auto' back-off):
  :meth:`GradAccMixin.get_micro_batch_size` and
  :meth:`GradAccMixin.accumulate_gradients`;
* autocast and the GradScaler's loss scaling:
  :meth:`GradAccMixin.train_step_single`; whether a step is skipped
  (``skip_nonfinite``, GradScaler): ``GradAccMixin._step_or_skip``;
* ``no_sync`` and the normalising all-reduce of a module wrapped in
  DistributedDataParallel: the methods after ``_ddp_module``, with the
  hook in :mod:`skorch_gradacc.communication`.
"""

import contextlib
import inspect
import numbers
import sys

import torch
from skorch.callbacks import LRScheduler, ProgressBar
from skorch.dataset import unpack_data
from skorch.utils import TeeGenerator
from torch.nn.parallel import DistributedDataParallel

from skorch_gradacc.batching import (
    batch_len,
    concat_outputs,
    detach_outputs,
    split_batch,
)
from skorch_gradacc.callbacks import GradAccProgressBar
from skorch_gradacc.communication import ScaledAllReduce, scaled_allreduce_hook

__all__ = ['GradAccMixin']


class GradAccMixin:
    """Mixin class that adds exact gradient accumulation to a skorch net.

    Use it with one of skorch's net classes, e.g. ``class
    MyNet(GradAccMixin, NeuralNetClassifier)``, or use one of the ready-made
    classes such as :class:`skorch_gradacc.GradAccNeuralNetClassifier`.

    With ``batch_size=B`` and ``acc_steps=k``, the net takes one optimizer
    step per group of ``k`` micro-batches of ``B`` samples. Only one
    micro-batch goes through the module at a time, so memory is that of
    batch size ``B``, while the update is the one plain skorch makes with
    ``batch_size=B * k`` on the same data in the same order: the same
    parameters, the same history and the same callback calls.

    How this is achieved:

    * The training iterator yields the whole group, ``B * k`` samples, as one
      batch. skorch's loop, callbacks and history therefore see exactly the
      batches that the large-batch net sees. The final, partial group of an
      epoch is the iterator's short last batch and is stepped like any
      other, before validation; nothing carries over into the next epoch.
    * :meth:`train_step` splits that batch into micro-batches of ``B`` rows
      and runs ``train_step_single`` (forward and ``backward``) on each.
    * The gradients add up. They are weighted by the number of items each
      micro-batch's loss averages over (see :meth:`count_loss_items`) and
      divided by the group's total, so a short last micro-batch or a partial
      group is weighted exactly as in the large batch's mean. A criterion
      with ``reduction='sum'`` is not rescaled at all.
    * ``on_grad_computed`` is notified once per step with the whole,
      normalised gradient, then all optimizers step once. The reported
      ``loss`` is the group's true mean loss, never a divided one.

    Validation and prediction run at ``batch_size``, untouched, unless
    ``micro_batch_size`` is set: then they are split as well.

    .. note::

       Layers whose output depends on the other samples of the batch, such
       as :class:`torch.nn.BatchNorm1d`, see micro-batches, not the group,
       so their statistics differ from the large-batch net's. Dropout draws
       its masks per micro-batch and so consumes random numbers in another
       order. Everything else matches.

    Parameters
    ----------
    acc_steps : int (default=1)
      The number of micro-batches of ``batch_size`` samples (or
      ``iterator_train__batch_size``, if set) whose gradients are
      accumulated before each optimizer step. ``acc_steps=1`` is plain
      skorch. Larger values than the number of micro-batches in an epoch
      are allowed and give one step per epoch.

    micro_batch_size : int, 'auto' or None (default=None)
      Split each batch into micro-batches of at most this many rows instead
      of ``batch_size`` rows. The effective batch stays ``batch_size *
      acc_steps``: everything that sees batches (history, callbacks,
      ``y_pred``) sees the full batch, and only micro-batches go through the
      module, also for validation and prediction. With ``'auto'``, the net
      starts with the whole batch and, on an out-of-memory error, frees what
      the attempt held, halves the micro-batch and retries the same batch,
      so the update equals the one without the error. The size that worked
      is kept in ``micro_batch_size_``. The sizes a batch backed off to are
      listed in its history row as ``micro_batch_size_backoff``; every epoch's
      row holds the ``micro_batch_size`` in use at its end (0 while whole
      batches fit), so that :class:`~skorch.callbacks.PrintLog` shows it.

    mixed_precision : None, 'bf16' or 'fp16' (default=None)
      Run each micro-batch's forward pass and loss under
      :class:`torch.autocast` with this dtype, as Accelerate's option of the
      same name does. With ``'fp16'``, a :class:`torch.amp.GradScaler`
      scales every micro-batch's loss for ``backward``, unscales the
      gradients once per group before ``on_grad_computed`` (so clipping sees
      true gradients), and steps and updates once per group; a step it skips
      does not advance per-batch LR schedulers and is counted as with
      ``skip_nonfinite``. The reported loss is never the scaled one.
      Validation and prediction run in full precision.

    skip_nonfinite : bool (default=False)
      If True, a step whose accumulated gradient holds inf or NaN is
      skipped: parameters and optimizer state stay unchanged, the gradient
      is zeroed, per-batch :class:`skorch.callbacks.LRScheduler` callbacks
      do not advance, the batch's history row gets ``step_skipped=True``,
      and the epoch's row counts ``skipped_steps``. Training goes on. If
      False, the step is taken, as in plain skorch.

    Attributes
    ----------
    micro_batch_size_ : int or None
      With ``micro_batch_size='auto'``, the micro-batch size found to fit;
      None while whole batches fit.

    grad_scaler_ : torch.amp.GradScaler or None
      The GradScaler of ``mixed_precision='fp16'``.

    step_skipped_ : bool
      Whether the last training step was skipped (``skip_nonfinite``).

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
    >>> net.history[-1, 'train_batch_count']  # ceil(80 / 32) steps
    3

    """

    def __init__(self, *args, acc_steps=1, micro_batch_size=None,
                 skip_nonfinite=False, mixed_precision=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps
        self.micro_batch_size = micro_batch_size
        self.skip_nonfinite = skip_nonfinite
        self.mixed_precision = mixed_precision

    def __init_subclass__(cls, **kwargs):
        # scikit-learn's estimator checks read the parameters from the
        # signature of __init__. Give each subclass an __init__ whose
        # signature is that of the net it extends plus the mixin's own
        # parameters, instead of the mixin's (*args, acc_steps=1, ...,
        # **kwargs).
        super().__init_subclass__(**kwargs)
        if '__init__' in vars(cls):
            return

        def __init__(self, *args, **kwargs):
            super(cls, self).__init__(*args, **kwargs)

        __init__.__signature__ = _signature_with_acc_steps(cls)
        __init__.__qualname__ = cls.__qualname__ + '.__init__'
        cls.__init__ = __init__

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
        if not _is_positive_int(self.acc_steps):
            raise ValueError(
                "acc_steps must be a positive integer, got {!r} instead."
                .format(self.acc_steps))
        micro_batch_size = self.micro_batch_size
        if not (micro_batch_size is None or micro_batch_size == 'auto'
                or _is_positive_int(micro_batch_size)):
            raise ValueError(
                "micro_batch_size must be None, 'auto' or a positive integer, "
                "got {!r} instead.".format(micro_batch_size))
        if not isinstance(self.skip_nonfinite, bool):
            raise ValueError(
                "skip_nonfinite must be True or False, got {!r} instead."
                .format(self.skip_nonfinite))
        if self.mixed_precision not in (None, 'bf16', 'fp16'):
            raise ValueError(
                "mixed_precision must be None, 'bf16' or 'fp16', got {!r} "
                "instead.".format(self.mixed_precision))
        decides_step = self.skip_nonfinite or self.mixed_precision == 'fp16'
        if decides_step and any(
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
        mro = type(self).__mro__
        if mro.index(GradAccMixin) < mro.index(hf.AccelerateMixin):
            raise ValueError(
                "Put AccelerateMixin before GradAccMixin in the bases of {}, "
                "e.g. class {}(AccelerateMixin, GradAccMixin, "
                "NeuralNetClassifier), so that the accelerator prepares the "
                "training iterator.".format(type(self).__name__,
                                            type(self).__name__))
        steps = getattr(self.accelerator, 'gradient_accumulation_steps', 1)
        if steps != 1:
            raise ValueError(
                "The accelerator accumulates gradients itself "
                "(gradient_accumulation_steps={}); with GradAccMixin, create "
                "it with gradient_accumulation_steps=1 and set acc_steps={} on "
                "the net instead.".format(steps, steps))

    def initialize_callbacks(self):
        """Initialize the callbacks; progress bars count optimizer steps.

        A plain :class:`skorch.callbacks.ProgressBar` in ``callbacks_`` is
        replaced by a :class:`skorch_gradacc.GradAccProgressBar` with the same
        parameters, whose bar is as long as the large-batch net's.

        """
        super().initialize_callbacks()
        self.callbacks_ = [
            (name, GradAccProgressBar(**cb.get_params()).initialize()
             if type(cb) is ProgressBar else cb)
            for name, cb in self.callbacks_
        ]
        return self

    def initialize(self):
        """Initialize the net; ``micro_batch_size='auto'`` starts afresh."""
        self.micro_batch_size_ = None
        self.grad_scaler_ = None
        return super().initialize()

    def get_train_batch_size(self):
        """Return the training batch size that ``acc_steps`` multiplies.

        That is ``iterator_train__batch_size`` if set, else ``batch_size``;
        ``-1`` stands for the whole training set. The training iterator yields
        ``acc_steps`` times as many rows per batch.

        """
        kwargs = self.get_params_for('iterator_train')
        return kwargs.get('batch_size', self.batch_size)

    def get_micro_batch_size(self):
        """Return the largest number of rows that go through the module at once.

        That is ``micro_batch_size`` if it is an integer, the size found so far
        if it is ``'auto'``, and else the training batch size
        (:meth:`get_train_batch_size`). ``None`` or ``-1`` mean that the whole
        batch goes through at once.

        """
        if self.micro_batch_size == 'auto':
            return getattr(self, 'micro_batch_size_', None)
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return self.get_train_batch_size()

    def get_iterator(self, dataset, training=False):
        """Get an iterator over the batches of ``dataset``.

        For training, each batch is a whole group: ``acc_steps`` times
        :meth:`get_train_batch_size` samples. The sampler does not depend on
        the batch size, so the samples come in the same order as for the
        smaller batch size, and the batches are those of a plain net with the
        effective batch size. Validation and prediction iterators are
        skorch's.

        """
        batch_size = self.get_train_batch_size()
        acc_steps = self.get_acc_steps()
        if not training or acc_steps == 1 or batch_size == -1:
            return super().get_iterator(dataset, training=training)

        kwargs = self.get_params_for('iterator_train')
        # int(): the DataLoader refuses numpy integers
        kwargs['batch_size'] = int(batch_size) * int(acc_steps)
        return self.iterator_train(dataset, **kwargs)

    def get_acc_steps(self):
        """Return the ``acc_steps`` in force for the current epoch.

        That is ``acc_steps``, unless an
        :class:`~skorch_gradacc.AccumulationScheduler` has set another value
        for this epoch (in ``acc_steps_``).

        """
        scheduled = getattr(self, 'acc_steps_', None)
        return self.acc_steps if scheduled is None else scheduled

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        """Forget a schedule's ``acc_steps`` from an earlier fit."""
        super().on_train_begin(net, X=X, y=y, **kwargs)
        self.acc_steps_ = None

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run skorch's epoch; rebuild the training iterator if needed.

        skorch creates the training iterator once per fit. When an
        :class:`~skorch_gradacc.AccumulationScheduler` changes ``acc_steps``
        at the start of an epoch, the iterator is created again, so that
        its batches are the new groups.

        """
        if training and iterator is not None:
            expected = self.get_train_batch_size()
            if expected != -1:
                expected *= self.get_acc_steps()
                if getattr(iterator, 'batch_size', None) not in (None, expected):
                    iterator = self.get_iterator(iterator.dataset, training=True)
        return super().run_single_epoch(
            iterator, training, prefix, step_fn, **fit_params)

    def count_loss_items(self, batch):
        """Return the number of items that a micro-batch's loss averages over.

        The gradients of the micro-batches are weighted by these counts and
        divided by their sum, which makes the update that of the mean over the
        whole group. Override this method when the criterion averages over
        something other than samples, e.g. over the non-padding tokens of a
        token-level loss, so that the accumulated update equals the large
        batch's.

        Parameters
        ----------
        batch
          A micro-batch ``(X, y)``.

        Returns
        -------
        count : int, float, or None
          The number of samples in ``X`` by default. ``None`` means that the
          loss is a sum, not a mean (the default when the criterion has
          ``reduction='sum'``), and is accumulated without any rescaling.

        Examples
        --------
        Weight by the targets that are not ignored by
        ``torch.nn.CrossEntropyLoss(ignore_index=-100)``:

        >>> from skorch import NeuralNet
        >>> class TokenNet(GradAccMixin, NeuralNet):
        ...     def count_loss_items(self, batch):
        ...         _, y = batch
        ...         return int((y != -100).sum())

        """
        if getattr(self.criterion_, 'reduction', None) == 'sum':
            return None
        return batch_len(batch)

    def _count_items(self, micro_batches):
        """Return the weights of the micro-batches and their normaliser.

        For a mean loss, these are the item counts and their sum; for a
        summed loss (``count_loss_items`` returns None), all weights are 1 and
        the normaliser is None: nothing is divided.

        """
        counts = [self.count_loss_items(micro) for micro in micro_batches]
        if all(count is None for count in counts):
            return [1] * len(counts), None
        if any(count is None for count in counts):
            raise ValueError(
                "count_loss_items returned None for some micro-batches but not "
                "for others: {}".format(counts))
        counts = [float(count) for count in counts]
        return counts, sum(counts)

    def _scale_gradients(self, factor):
        """Multiply the gradients of all learnable parameters in place."""
        grads = [param.grad for _, param in self.get_all_learnable_params()
                 if param.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def accumulate_gradients(self, batch, **fit_params):
        """Compute the gradient of a whole batch, one micro-batch at a time.

        Runs ``train_step_single`` (forward and backward) on each micro-batch
        of ``batch``. Between micro-batches the summed gradient is rescaled so
        that, at the end, it is the gradient of the mean loss over all the
        items of ``batch``: the gradient a single ``train_step_single`` on
        the whole batch would give, while only one micro-batch is in memory.
        Overridden ``train_step_single`` and ``get_loss`` methods are used
        as they are: this method never touches the loss.

        Parameters
        ----------
        batch
          One batch of the training iterator, i.e. a whole group.

        **fit_params : dict
          Additional parameters passed to ``train_step_single``.

        Returns
        -------
        step : dict
          ``{'loss': loss, 'y_pred': y_pred}``: the mean loss over the batch
          and the module's outputs for all of its rows, both detached. A
          batch that fits in one micro-batch goes to ``train_step_single``
          as a whole, and its result is returned unchanged, as in skorch.

        """
        while True:
            try:
                return self._accumulate_gradients(batch, **fit_params)
            except _OUT_OF_MEMORY_ERRORS:
                if self.micro_batch_size != 'auto':
                    raise
            # outside the except block, so that the failed attempt's
            # tensors, held by the traceback, are freed
            self._back_off_micro_batch_size(batch)

    def _back_off_micro_batch_size(self, batch):
        """Halve the micro-batch after an out-of-memory error."""
        self._zero_grad_optimizer()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rows = batch_len(batch)
        current = min(self.micro_batch_size_ or rows, rows)
        if current <= 1:
            raise RuntimeError(
                "micro_batch_size='auto': a micro-batch of one row does not fit "
                "in memory; use a smaller model or less data per row.")
        self.micro_batch_size_ = (current + 1) // 2
        # each back-off once, in the row of the batch that backed off
        row = self.history[-1]['batches'][-1]
        row['micro_batch_size_backoff'] = row.get(
            'micro_batch_size_backoff', []) + [self.micro_batch_size_]

    def _accumulate_gradients(self, batch, **fit_params):
        micro_batch_size = self.get_micro_batch_size()
        if micro_batch_size in (None, -1) or batch_len(batch) <= micro_batch_size:
            if not self._is_distributed():
                return self._train_step_single_checked(batch, **fit_params)
            micro_batches = [batch]
        else:
            micro_batches = split_batch(batch, micro_batch_size)
        self._ensure_comm_hook()
        counts, local_total = self._count_items(micro_batches)
        if local_total is None:  # a summed loss: nothing to divide by
            local_total = total = 1
        else:  # a mean: divide by the items of the group on all processes
            total = self._global_count(local_total)
        nonempty = [i for i, count in enumerate(counts) if count]
        last = nonempty[-1] if nonempty else None
        if last is None and self._is_distributed():
            raise RuntimeError(
                "A group with no items to average over reached a distributed "
                "step; every rank must contribute to every step.")

        losses, y_preds = [], []
        # .grad holds the sum over finished micro-batches j of
        # (counts[j] / unit) * gradient_j; unit changes only when the counts
        # do, so equal-sized micro-batches cost no rescaling until the end.
        unit, normalised = None, False
        for index, (micro, count) in enumerate(zip(micro_batches, counts)):
            if count == 0:  # nothing to average over: no gradient, no loss
                y_preds.append(self._infer_without_grad(micro, **fit_params))
                continue
            if unit is not None and count != unit:
                self._scale_gradients(unit / count)
            unit = count
            if index == last:
                # a distributed net normalises while it synchronises
                normalised = self._normalise_when_syncing(unit / total)
            with self._micro_batch_context(is_last=index == last):
                step = self._train_step_single_checked(micro, **fit_params)
            losses.append(count * step['loss'].detach())
            y_preds.append(detach_outputs(step['y_pred']))
            del step  # frees the micro-batch's graph before the next forward
        if not normalised and unit is not None and unit != total:
            self._scale_gradients(unit / total)

        if not losses:  # no item in the whole batch: the mean is undefined
            return {'loss': torch.tensor(float('nan')),
                    'y_pred': concat_outputs(y_preds)}
        return {
            'loss': torch.stack(losses).sum() / local_total,
            'y_pred': concat_outputs(y_preds),
        }

    # Data-parallel training: when the module is wrapped in
    # DistributedDataParallel (by DistributedGradAccMixin or by skorch's
    # AccelerateMixin), non-step micro-batches run under no_sync, and a
    # communication hook normalises by the group's items on all processes.

    def _ddp_module(self):
        module = getattr(self, 'module_', None)
        return module if isinstance(module, DistributedDataParallel) else None

    def _is_distributed(self):
        return self._ddp_module() is not None

    def _global_count(self, total):
        """Return the group's item count over all processes."""
        if not self._is_distributed():
            return total
        count = torch.tensor([float(total)], dtype=torch.float64)
        torch.distributed.all_reduce(count)
        return count.item()

    def _micro_batch_context(self, is_last):
        """Return the context for one micro-batch's forward and backward."""
        ddp = self._ddp_module()
        if ddp is None or is_last:
            return contextlib.nullcontext()
        return ddp.no_sync()

    def _ensure_comm_hook(self):
        """Register the normalising all-reduce hook on the DDP module, once."""
        ddp = self._ddp_module()
        state = getattr(self, 'comm_state_', None)
        if ddp is not None and (state is None or state.module is not ddp):
            self.comm_state_ = ScaledAllReduce(ddp)
            ddp.register_comm_hook(self.comm_state_, scaled_allreduce_hook)

    def _normalise_when_syncing(self, factor):
        """Multiply the gradient by ``factor`` while it is synchronised.

        Return whether that happens; if not, the net multiplies it itself.
        """
        if not self._is_distributed():
            return False
        self.comm_state_.factor = factor
        return True

    def _eval_micro_batches(self, batch):
        """Split ``batch`` for validation or prediction, or return None.

        Only with ``micro_batch_size`` set do validation and prediction
        batches go through the module in micro-batches; otherwise they are
        ``batch_size`` rows already.

        """
        size = self.get_micro_batch_size()
        if (self.micro_batch_size is None or size is None
                or batch_len(batch) <= size):
            return None
        return split_batch(batch, size)

    def validation_step(self, batch, **fit_params):
        """Run skorch's validation step, one micro-batch at a time if needed.

        With ``micro_batch_size`` set, the loss is the mean over the batch,
        weighted by :meth:`count_loss_items` as in training, and ``y_pred``
        holds the outputs for all rows.

        """
        micro_batches = self._eval_micro_batches(batch)
        if micro_batches is None:
            return super().validation_step(batch, **fit_params)
        counts, total = self._count_items(micro_batches)
        total = 1 if total is None else total
        steps = [super(GradAccMixin, self).validation_step(micro, **fit_params)
                 for micro in micro_batches]
        weighted = [count * step['loss'] for count, step in zip(counts, steps)
                    if count]
        return {
            'loss': torch.stack(weighted).sum() / total if weighted
            else torch.tensor(float('nan')),
            'y_pred': concat_outputs([step['y_pred'] for step in steps]),
        }

    def evaluation_step(self, batch, training=False):
        """Run skorch's evaluation step, one micro-batch at a time if needed."""
        micro_batches = self._eval_micro_batches(batch)
        if micro_batches is None:
            return super().evaluation_step(batch, training=training)
        return concat_outputs([
            super(GradAccMixin, self).evaluation_step(micro, training=training)
            for micro in micro_batches])

    def _device_type(self):
        return torch.device(self.device).type if self.device else 'cpu'

    def _get_grad_scaler(self):
        """Return the GradScaler for ``mixed_precision='fp16'``, else None."""
        if self.mixed_precision != 'fp16':
            return None
        if getattr(self, 'grad_scaler_', None) is None:
            self.grad_scaler_ = torch.amp.GradScaler(self._device_type())
        return self.grad_scaler_

    def train_step_single(self, batch, **fit_params):
        """Forward and backward on one micro-batch, in mixed precision if set.

        Without ``mixed_precision`` this is skorch's ``train_step_single``.
        With it, the forward pass and the loss run under
        :class:`torch.autocast`, and with ``'fp16'`` the loss is scaled by the
        GradScaler for ``backward`` only: the loss that is returned, and
        recorded, is never the scaled one. An override of this method must
        call ``super().train_step_single`` when ``mixed_precision='fp16'``.

        """
        if self.mixed_precision is None:
            return super().train_step_single(batch, **fit_params)
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        with torch.autocast(self._device_type(),
                            dtype=_AUTOCAST_DTYPES[self.mixed_precision]):
            y_pred = self.infer(Xi, **fit_params)
            loss = self.get_loss(y_pred, yi, X=Xi, training=True)
        scaler = self._get_grad_scaler()
        (loss if scaler is None else scaler.scale(loss)).backward()
        self.scaled_backwards_ = getattr(self, 'scaled_backwards_', 0) + 1
        return {'loss': loss, 'y_pred': y_pred}

    def _unscale_gradients(self):
        """Undo the GradScaler's scale, once per group, before callbacks."""
        scaler = self._get_grad_scaler()
        if scaler is None:
            return
        for name in self._optimizers:
            scaler.unscale_(getattr(self, name + '_'))

    def _step_or_skip(self):
        """Step all optimizers unless the step must be skipped.

        Used when ``skip_nonfinite`` or a GradScaler decides about the step.
        Returns whether the step was skipped.

        """
        scaler = self._get_grad_scaler()
        if self.skip_nonfinite and not self._gradients_are_finite():
            if scaler is not None:
                scaler.update()  # unscale_ saw the inf: lower the scale
            return self._finish_step(skipped=True)
        if scaler is None:
            self._step_optimizer(None)
            return self._finish_step(skipped=False)
        scale = scaler.get_scale()
        for name in self._optimizers:
            scaler.step(getattr(self, name + '_'))
        scaler.update()
        # on inf/NaN the scaler skips the step and lowers the scale
        return self._finish_step(skipped=scaler.get_scale() < scale)

    def _finish_step(self, skipped):
        if skipped:
            self._zero_grad_optimizer()
        self.history.record_batch('step_skipped', skipped)
        return skipped

    def _gradients_are_finite(self):
        grads = [param.grad for _, param in self.get_all_learnable_params()
                 if param.grad is not None]
        if not grads:
            return True
        return bool(torch.stack([torch.isfinite(grad).all() for grad in grads])
                    .all())

    def notify(self, method_name, **cb_kwargs):
        """Call the callbacks; a skipped step does not advance LR schedulers.

        When ``skip_nonfinite=True`` skipped the optimizer step of a batch,
        ``on_batch_end`` is not passed to :class:`skorch.callbacks.LRScheduler`
        callbacks that step every batch, so that they count applied updates.

        """
        if not (method_name == 'on_batch_end' and cb_kwargs.get('training')
                and getattr(self, 'step_skipped_', False)):
            return super().notify(method_name, **cb_kwargs)
        # skorch's notify, except for the marked line
        getattr(self, method_name)(self, **cb_kwargs)
        for _, cb in self.callbacks_:
            if isinstance(cb, LRScheduler) and cb.step_every == 'batch':  # <=
                continue
            getattr(cb, method_name)(self, **cb_kwargs)
        return None

    def on_epoch_end(self, net, **kwargs):
        """Record the epoch's micro-batch size and skipped steps, if used."""
        super().on_epoch_end(net, **kwargs)
        if self.micro_batch_size == 'auto':
            # in every epoch's row, so that PrintLog's columns stay aligned;
            # 0 while whole batches fit
            self.history.record('micro_batch_size', self.micro_batch_size_ or 0)
        if self.skip_nonfinite or self.mixed_precision == 'fp16':
            skipped = sum(row.get('step_skipped', False)
                          for row in self.history[-1, 'batches'])
            self.history.record('skipped_steps', skipped)

    def _train_step_single_checked(self, batch, **fit_params):
        """Run ``train_step_single``; with fp16, check that it scaled."""
        if self.mixed_precision != 'fp16':
            return self.train_step_single(batch, **fit_params)
        before = getattr(self, 'scaled_backwards_', 0)
        step = self.train_step_single(batch, **fit_params)
        if getattr(self, 'scaled_backwards_', 0) != before + 1:
            raise RuntimeError(
                "mixed_precision='fp16' scales the loss in "
                "GradAccMixin.train_step_single; an override of "
                "train_step_single must call super().train_step_single.")
        return step

    def _infer_without_grad(self, batch, **fit_params):
        self._set_training(True)
        # X is the first member, also of batches with more than (X, y)
        Xi = batch[0] if isinstance(batch, (tuple, list)) else batch
        with torch.no_grad():
            return self.infer(Xi, **fit_params)

    def train_step(self, batch, **fit_params):
        """Take one optimizer step on a batch, i.e. on a whole group.

        This is skorch's ``train_step``, except that the gradient is computed
        by :meth:`accumulate_gradients`, one micro-batch at a time. The
        optimizers are zeroed once and step once per group, and
        ``on_grad_computed`` is notified once, with the normalised gradient of
        the group. Closure optimizers such as LBFGS re-evaluate the whole
        group whenever they call the closure.

        If an exception or ``KeyboardInterrupt`` stops the group midway, the
        optimizers have not stepped, so parameters and optimizer state are
        those of the last completed step, and the partial gradient is
        discarded before the exception propagates.

        Returns
        -------
        step : dict
          ``{'loss': loss, 'y_pred': y_pred}`` for the whole group.

        """
        # This mirrors NeuralNet.train_step, except for the marked lines and
        # the decision whether to step (skip_nonfinite, GradScaler).
        step_accumulator = self.get_train_step_accumulator()

        def step_fn():
            self._zero_grad_optimizer()
            step = self.accumulate_gradients(batch, **fit_params)  # <= changed
            self._unscale_gradients()  # <= added: callbacks see true gradients
            step_accumulator.store_step(step)

            self.notify(
                'on_grad_computed',
                named_parameters=TeeGenerator(self.get_all_learnable_params()),
                batch=batch,
                training=True,
            )
            return step['loss']

        self.step_skipped_ = False
        try:
            if self.skip_nonfinite or self.mixed_precision == 'fp16':
                step_fn()
                self.step_skipped_ = self._step_or_skip()
            else:
                self._step_optimizer(step_fn)
        except BaseException:
            # An error or Ctrl-C in the middle of the group: the optimizers
            # have not stepped, and the partial gradient must not survive.
            self._zero_grad_optimizer()
            raise
        return step_accumulator.get_step()


def _is_positive_int(value):
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and value >= 1)


_AUTOCAST_DTYPES = {None: None, 'bf16': torch.bfloat16, 'fp16': torch.float16}

_OUT_OF_MEMORY_ERRORS = (torch.cuda.OutOfMemoryError,) + (
    (torch.OutOfMemoryError,) if hasattr(torch, 'OutOfMemoryError') else ())


def _signature_with_acc_steps(cls):
    """Return the signature of the ``__init__`` that ``cls`` extends.

    That is the ``__init__`` that GradAccMixin's ``super()`` reaches, with
    ``acc_steps`` added as a keyword-only parameter.
    """
    mro = cls.__mro__
    extended = next(klass for klass in mro[mro.index(GradAccMixin) + 1:]
                    if '__init__' in vars(klass))
    signature = inspect.signature(extended.__init__)
    params = [param for param in signature.parameters.values()
              if param.kind != param.VAR_KEYWORD]
    params.extend(
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in [('acc_steps', 1), ('micro_batch_size', None),
                              ('skip_nonfinite', False),
                              ('mixed_precision', None)])
    params.extend(param for param in signature.parameters.values()
                  if param.kind == param.VAR_KEYWORD)
    return signature.replace(parameters=params)
