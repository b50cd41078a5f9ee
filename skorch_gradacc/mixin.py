"""The mixin that gives a skorch net exact gradient accumulation.

Where things happen, one place each: the groups of micro-batches,
:meth:`GradAccMixin.run_single_epoch` and :mod:`skorch_gradacc.grouping`;
the step, :meth:`GradAccMixin.train_step`; forward, backward and the
weighting of each micro-batch, :meth:`GradAccMixin.accumulate_gradients`;
mixed precision and skipped steps, :mod:`skorch_gradacc.precision`;
what differs between one process, DDP and FSDP2, the engine
(:mod:`skorch_gradacc.engine`).
"""


import torch
from skorch.utils import TeeGenerator
from torch.utils.data import DistributedSampler

from skorch_gradacc.batching import (
    batch_len,
    concat_outputs,
    detach_outputs,
    uncompiled,
)
from skorch_gradacc.callbacks import (
    callback_reads,
    count_steps_in_progress_bars,
    outputs_needed,
)
from skorch_gradacc.counting import (
    LOSS_CHECK_TRIES,
    ItemCounts,
    StepExtras,
    check_loss_while_pending,
    count_items,
    get_loss_weighted,
    merge_piece_records,
    scale_gradients,
    validate_in_pieces,
    warn_of_batch_norm,
)
from skorch_gradacc.engine import (
    DataParallelEngine,
    Engine,
    PaddingMixin,
    engine_for,
    learnable_gradients,
)
from skorch_gradacc.grouping import (
    MicroBatchGroup,
    forget_unloaded_group,
    set_sampler_epoch,
)
from skorch_gradacc.memory import (
    accumulate_within_budget,
    eval_pieces,
    fit_memory,
    micro_batch_pieces,
    note_pass_error,
)
from skorch_gradacc.params import (
    add_combined_init,
    check_accelerate,
    check_bases,
    check_grad_acc_params,
)
from skorch_gradacc.precision import PrecisionMixin

__all__ = ['GradAccMixin']


class GradAccMixin(PaddingMixin, PrecisionMixin):
    """Mixin class that adds exact gradient accumulation to a skorch net.

    Use it in front of one of skorch's net classes, e.g. ``class
    MyNet(GradAccMixin, NeuralNetClassifier)``, or use one of the ready-made
    classes such as :class:`skorch_gradacc.GradAccNeuralNetClassifier`.

    With ``acc_steps=k``, the net takes one optimizer step per group of
    ``k`` consecutive micro-batches of its training iterator, holding one
    at a time, and trains as plain skorch at ``batch_size=B * k``: the same
    parameters, history (a row per step) and callback calls. The docs' "How
    it works" page says how, its compatibility page what cannot match.

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
      the history and callbacks see the batches. ``'auto'`` plans the
      largest pieces that keep ``memory_budget``, and halves them after an
      allocation error, with the same update (the docs' memory page).

    memory_budget : None, int or str (default=None)
      With ``micro_batch_size='auto'`` only: the peak memory the fit may
      add to what the process holds when ``fit`` starts (e.g. ``'2GiB'``),
      as a container or a GPU counts it; per rank. None: what the device
      gives (:func:`skorch_gradacc.meters.available_memory`). A budget that
      one row does not fit raises a ValueError before the first step.

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
      Check on the first 3 pieces of a fit from scratch that trains in
      groups, with four forward passes of each and its pieces, that the loss
      is a mean over what :meth:`~skorch_gradacc.GradAccMixin.count_loss_items`
      counts; else warn with a :class:`~skorch_gradacc.LossItemsWarning`.

    Attributes
    ----------
    micro_batch_size_ : int or None
      With ``micro_batch_size='auto'``, the size found to fit; None while
      whole micro-batches fit.

    memory_plan_ : dict or None
      With ``micro_batch_size='auto'``, the plan of
      :func:`~skorch_gradacc.memory.plan_memory`.

    memory_meter_ : skorch_gradacc.meters.MemoryMeter or None
      While a fit with ``micro_batch_size='auto'`` runs, what measures it.

    grad_scaler_, step_skipped_
      The GradScaler of ``mixed_precision='fp16'`` (else None), and whether
      the last training step was skipped.

    engine_ : skorch_gradacc.engine.Engine
      The engine of ``module_`` (one process, DDP, FSDP2); see
      :meth:`get_engine`.

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
        # signature of __init__ (params.add_combined_init)
        super().__init_subclass__(**kwargs)
        add_combined_init(cls)

    # Validation, before any training happens

    def _validate_params(self):
        super()._validate_params()
        check_grad_acc_params(self)
        check_accelerate(self, GradAccMixin)
        check_bases(self, GradAccMixin)

    def check_training_readiness(self):
        """Check that the net is ready to train, its own parameters included."""
        super().check_training_readiness()
        # set_params() does not run _validate_params for ordinary attributes:
        # a bad value set after initialization is caught here, before training
        check_grad_acc_params(self)
        check_accelerate(self, GradAccMixin)

    # Initialization

    def initialize_callbacks(self):
        """Initialize the callbacks; a bad ``train_batch_reads`` raises."""
        super().initialize_callbacks()
        for cb in [self] + [cb for _, cb in self.callbacks_]:  # the net's hooks too
            callback_reads(self, cb)
        return self

    def notify(self, method_name, **cb_kwargs):
        """Call the callbacks; a ``ProgressBar`` is told the epoch's steps."""
        super().notify(method_name, **cb_kwargs)
        if method_name == 'on_epoch_begin':
            count_steps_in_progress_bars(  # W ranks: acc_steps * W a step
                self, cb_kwargs.get('dataset_train'),
                self.get_acc_steps() * self.get_engine().world_size)

    def initialize_virtual_params(self):
        """Initialize virtual params, and ``'auto'``'s plan and fp16's scaler anew."""
        # the first step of skorch's initialize, and of AccelerateMixin's copy
        self.micro_batch_size_ = self.grad_scaler_ = None
        self.memory_plan_ = self._plan_verify_ = None
        return super().initialize_virtual_params()

    def fit(self, X, y=None, **fit_params):
        """Fit as skorch does; ``'auto'`` measures memory from here."""
        with fit_memory(self):
            return super().fit(X, y, **fit_params)

    def partial_fit(self, X, y=None, classes=None, **fit_params):
        """Fit the module further, as skorch does; see :meth:`fit`."""
        with fit_memory(self):
            return super().partial_fit(X, y, classes=classes, **fit_params)

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

        ``acc_steps`` as the fit began (set in a fit, it waits for the next,
        as ``batch_size``), unless an :class:`~skorch_gradacc.AccumulationScheduler`
        set ``acc_steps_`` for this epoch.
        """
        scheduled = getattr(self, 'acc_steps_', None)
        return self.acc_steps if scheduled is None else scheduled

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        """Take the fit's ``acc_steps``; a fit from scratch checks its loss."""
        super().on_train_begin(net, X=X, y=y, **kwargs)
        self.acc_steps_ = self.acc_steps
        self.loss_check_pending_ = LOSS_CHECK_TRIES if (
            self.check_loss and not len(self.history)) else 0
        warn_of_batch_norm(self)

    # The epoch: one batch per group

    def get_train_outputs_needed(self):
        """Return what is kept of a training group for the callbacks.

        What the large-batch net would pass to the callbacks that read it
        (the docs' memory page). A callback of your own declares what it
        reads in the class attribute ``train_batch_reads``: ``'X'``, ``'y'``,
        ``'y_pred'``, or ``()``.

        Returns
        -------
        needed : dict
          ``{'batch': bool, 'X': bool, 'y': bool, 'y_pred': bool,
          'at_begin': bool}``: whether the group keeps its micro-batches,
          whether callbacks read them, its targets, its outputs, and the
          batch in ``on_batch_begin``.

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
        {'batch': False, 'X': False, 'y': True, 'y_pred': True, 'at_begin': False}

        """
        return outputs_needed(self)

    def _trains_in_groups(self):
        """Whether training needs the group loop; else it is plain skorch's."""
        return (self.get_acc_steps() != 1 or self.micro_batch_size is not None
                or self._decides_step() or self.mixed_precision is not None
                or isinstance(self.get_engine(), DataParallelEngine))

    def get_engine(self):
        """Return the engine of ``module_`` (:mod:`skorch_gradacc.engine`)."""
        engine = getattr(self, 'engine_', None)
        module = uncompiled(getattr(self, 'module_', None))  # compile=True's
        if engine is None or engine.module is not module:
            engine = self.engine_ = self.make_engine()
        return engine

    def __getstate__(self):
        # the engine holds module_, which skorch pickles apart (to load anywhere):
        # get_engine makes anew; a fit's meter and plan measure this process
        return {key: value for key, value in super().__getstate__().items()
                if key not in ('engine_', 'memory_meter_', '_plan_verify_')}

    def make_engine(self):
        """Return a new engine for ``module_``; see :meth:`get_engine`."""
        return engine_for(getattr(self, 'module_', None),
                          fp16=self.mixed_precision == 'fp16')

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run skorch's epoch; in training, over the engine's groups.

        One batch per optimizer step
        (:class:`~skorch_gradacc.grouping.MicroBatchGroups`). A
        ``DistributedSampler`` gets ``set_epoch`` with the epoch's index,
        unless the user set its epoch.
        """
        sampler = getattr(iterator, 'sampler', None)
        if training and isinstance(sampler, DistributedSampler):
            # from 0; the epoch's row is in the history, a resumed run's too
            set_sampler_epoch(self, sampler, max(len(self.history) - 1, 0))
        if training and iterator is not None and self._trains_in_groups():
            needed = self.get_train_outputs_needed()
            self._keep_train_y_pred_ = needed['y_pred']
            # over all ranks, for the callbacks that read the batch
            self._share_train_step_ = needed['X'] or needed['y'] or needed['y_pred']
            iterator = self.get_engine().groups(
                iterator, self.get_acc_steps(), keep=needed['batch'],
                keep_targets=needed['y'], share_inputs=needed['at_begin'])
        try:
            return super().run_single_epoch(
                iterator, training, prefix, step_fn, **fit_params)
        except Exception as error:
            forget_unloaded_group(self.history, prefix, error)
            raise

    # The step

    def train_step(self, batch, **fit_params):
        """Take one optimizer step on a group of micro-batches.

        skorch's ``train_step``, with the gradient of :meth:`accumulate_gradients`.
        An exception midway discards the partial gradient; the optimizers have
        not stepped. Where callbacks read the batch or outputs, the engine
        gives those of all ranks (:meth:`~skorch_gradacc.engine.Engine.share_step`).
        """
        if not isinstance(batch, MicroBatchGroup):  # plain skorch's training
            return super().train_step(batch, **fit_params)
        # skorch's NeuralNet.train_step, except for the marked line
        step_accumulator = self.get_train_step_accumulator()

        def step_fn():
            self._zero_grad_optimizer()
            step = self.accumulate_gradients(batch, **fit_params)  # <= changed
            if getattr(self, '_share_train_step_', False):  # <= added: all ranks'
                step = self.get_engine().share_step(batch, step)
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
            # midway (an error, Ctrl-C): no optimizer stepped; drop the partial gradient
            self._zero_grad_optimizer()
            raise
        return _as_skorch_step(step_accumulator.get_step())

    # Accumulation and normalization

    def count_loss_items(self, batch):
        """Return the number of items that a micro-batch's loss averages over.

        Weighted by these counts, the update is the mean's over the group.
        By default, what the criterion divides by
        (:func:`~skorch_gradacc.counting.count_items`).

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

        The one loop of every engine: ``train_step_single`` on each piece,
        whose loss leaves ``get_loss`` with the gradient of the loss times
        its :meth:`count_loss_items` (in units of the engine's ``count_unit``,
        else of the first positive count); the engine's ``end_step`` divides
        by the total once. Returns the group's mean loss and, if a callback
        reads them, its outputs, both detached; other keys of the pieces'
        steps, a float merged as the loss, else the last piece's value.
        """
        if self.micro_batch_size == 'auto':  # planned, and backs off
            return accumulate_within_budget(
                self, group, self._accumulate_gradients, **fit_params)
        return self._accumulate_gradients(group, **fit_params)

    def _accumulate_gradients(self, group, **fit_params):
        self._piece_records_, y_preds, extras = [], [], StepExtras()
        engine = self.get_engine()
        keep_y_pred = getattr(self, '_keep_train_y_pred_', False)
        counts = ItemCounts(count_unit=engine.count_unit, share=engine.share_count_unit,
                            name='count_loss_items(batch)')
        for piece, is_last in engine.passes(self._pieces(group)):
            if not counts.add(self.count_loss_items(piece),
                              skippable=engine.may_skip(is_last)):
                # no item: adds nothing to the mean that the large batch takes
                if keep_y_pred:
                    y_preds.append((self._infer_without_grad(
                        piece, **fit_params), batch_len(piece)))
                del piece
                continue
            if is_last:
                engine.set_count_unit(None if counts.summed else (
                    0.0 if counts.count_unit is None else counts.count_unit))
            try:
                step = self._train_piece(piece, counts, is_last, **fit_params)
            except Exception as error:
                if self.micro_batch_size == 'auto':
                    note_pass_error(self, error, group, is_last, **fit_params)
                raise
            counts.add_loss(step['loss'].detach())
            extras.add(counts.count, step)  # the user's own keys
            # a zero-row piece's too where it is the first: a rank without
            # rows in the step passes callbacks outputs of no rows, not None
            if keep_y_pred and (batch_len(piece) or not y_preds):
                y_preds.append((detach_outputs(step['y_pred']), batch_len(piece)))
            del step, piece  # frees the piece's graph and outputs
        loss = engine.end_step(self, group, counts)
        self._unscale_gradients()  # callbacks see true gradients
        merge_piece_records(self._current_batch_row(), self._piece_records_)
        y_pred = concat_outputs(*map(list, zip(*y_preds))) if y_preds else None
        return {**extras.merged(), 'loss': loss, 'y_pred': self.in_module_dtype(y_pred)}

    def _pieces(self, group):
        """Yield ``(piece, is_last)`` for the pieces of ``group``.

        A piece is a micro-batch, or a slice of ``micro_batch_size`` rows
        (with a memory plan, of its cost).
        """
        for index, micro in enumerate(group.micro_batches()):
            pieces = micro_batch_pieces(self, micro, group)
            del micro  # held by pieces until the next one is pulled
            for piece, last in pieces:
                yield piece, last and group.is_last(index)
                del piece
            del pieces

    def _train_piece(self, piece, counts, is_last, **fit_params):
        """Run ``train_step_single`` on one piece, weighted by its count.

        In the engine's context and under :meth:`autocast`, with ``get_loss``
        weighted (:func:`~skorch_gradacc.counting.get_loss_weighted`). A
        piece without items (weight 0) gets a zero gradient through its
        outputs. Values recorded in the history row are noted for
        :func:`~skorch_gradacc.counting.merge_piece_records`.
        """
        check_loss_while_pending(self, piece, **fit_params)
        row = self._current_batch_row()
        before = dict(row) if row is not None else None
        weight, scaler = counts.weight, self._get_grad_scaler()
        # a train_step_single that computed its loss without get_loss on an
        # earlier piece: in one process, .grad is rescaled around it instead
        alone = type(self.get_engine()) is Engine and isinstance(weight, float)
        rescale = (getattr(counts, 'without_get_loss', False) and alone
                   and weight not in (0, 1))
        if rescale:
            scale_gradients(learnable_gradients(self), 1 / weight)
            weight = 1.0
        with (get_loss_weighted(self, weight, scaler) as calls,
              self.get_engine().context(is_last, self), self.autocast()):
            step = self.train_step_single(piece, **fit_params)
        if rescale:
            scale_gradients(learnable_gradients(self), counts.weight)
        if not calls:
            if alone and not weight and not counts.total:
                # no item yet: the user's mean of none (NaN) adds nothing
                self._zero_grad_optimizer()
            elif (scaler is not None or isinstance(weight, torch.Tensor)
                    or weight not in (None, 1)):
                raise RuntimeError(_WITHOUT_GET_LOSS)
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

    def _infer_without_grad(self, batch, **fit_params):
        self._set_training(True)
        # X is the first member, also of batches with more than (X, y)
        Xi = batch[0] if isinstance(batch, (tuple, list)) else batch
        with torch.no_grad(), self.autocast():
            return self.infer(Xi, **fit_params)

    # micro_batch_size='auto'

    def on_epoch_end(self, net, **kwargs):
        """Record the epoch's micro-batch size, with ``'auto'``."""
        if self.micro_batch_size == 'auto':
            # in every epoch's row, so that PrintLog's columns stay aligned;
            # 0 while whole micro-batches fit
            self.history.record('micro_batch_size', self.micro_batch_size_ or 0)
        super().on_epoch_end(net, **kwargs)

    # Validation and prediction with micro_batch_size

    def eval_pieces(self, batch):
        """Return a validation or prediction batch's pieces (None: whole)."""
        return eval_pieces(self, batch)

    def validation_step(self, batch, **fit_params):
        """Run skorch's validation step, in pieces if ``micro_batch_size`` is set.

        The loss is then the mean over the batch, weighted by
        :meth:`count_loss_items` as in training.
        """
        pieces = self.eval_pieces(batch)
        if pieces is None:
            return super().validation_step(batch, **fit_params)
        return validate_in_pieces(self, pieces, super().validation_step,
                                  **fit_params)

    def evaluation_step(self, batch, training=False):
        """Run skorch's evaluation step, in pieces if ``micro_batch_size`` is set."""
        pieces = self.eval_pieces(batch)
        if pieces is None:
            return super().evaluation_step(batch, training=training)
        return concat_outputs([super(GradAccMixin, self).evaluation_step(
            piece, training=training) for piece in pieces], [*map(batch_len, pieces)])


_WITHOUT_GET_LOSS = (
    "GradAccMixin weights each micro-batch's loss (and, with "
    "mixed_precision='fp16', scales it) as it leaves get_loss; an override of "
    "train_step_single must compute the loss with self.get_loss(..., "
    "training=True).")


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
