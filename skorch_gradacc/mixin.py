"""The mixin that gives a skorch net exact gradient accumulation.

Where things happen, in one place each:

* the group of ``acc_steps`` micro-batches is one batch of the training
  iterator: :meth:`GradAccMixin.get_iterator`;
* the optimizer step, once per group: :meth:`GradAccMixin.train_step`;
* forward and backward on each micro-batch, and the normalisation of the
  summed gradient: :meth:`GradAccMixin.accumulate_gradients`;
* what a micro-batch's loss is averaged over:
  :meth:`GradAccMixin.count_loss_items`.
"""

import inspect
import numbers
import sys

import torch
from skorch.callbacks import ProgressBar
from skorch.dataset import unpack_data
from skorch.utils import TeeGenerator

from skorch_gradacc.batching import (
    batch_len,
    concat_outputs,
    detach_outputs,
    split_batch,
)
from skorch_gradacc.callbacks import GradAccProgressBar

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

    Validation and prediction are untouched and run at ``batch_size``.

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

    def __init__(self, *args, acc_steps=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps

    def __init_subclass__(cls, **kwargs):
        # scikit-learn's estimator checks read the parameters from the
        # signature of __init__. Give each subclass an __init__ whose
        # signature is that of the net it extends plus acc_steps, instead of
        # the mixin's (*args, acc_steps=1, **kwargs).
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
        self._check_acc_steps()
        self._check_accelerate()

    def check_training_readiness(self):
        """Check that the net is ready to train, ``acc_steps`` included."""
        super().check_training_readiness()
        # set_params() does not run _validate_params for ordinary attributes,
        # so a bad acc_steps set after initialization is caught here, before
        # any training happens.
        self._check_acc_steps()

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

    def _check_acc_steps(self):
        acc_steps = self.acc_steps
        if (
                isinstance(acc_steps, bool)
                or not isinstance(acc_steps, numbers.Integral)
                or acc_steps < 1
        ):
            raise ValueError(
                "acc_steps must be a positive integer, got {!r} instead."
                .format(acc_steps)
            )

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

    def get_micro_batch_size(self):
        """Return the number of rows in one training micro-batch.

        This is ``iterator_train__batch_size`` if set, else ``batch_size``.
        ``-1`` stands for the whole training set.

        """
        kwargs = self.get_params_for('iterator_train')
        return kwargs.get('batch_size', self.batch_size)

    def get_iterator(self, dataset, training=False):
        """Get an iterator over the batches of ``dataset``.

        For training, each batch is a whole group: ``acc_steps`` micro-batches
        of :meth:`get_micro_batch_size` samples. The sampler does not depend on
        the batch size, so the samples come in the same order as for the
        micro-batch size, and the batches are those of a plain net with the
        effective batch size. Validation and prediction iterators are
        skorch's.

        """
        micro_batch_size = self.get_micro_batch_size()
        if not training or self.acc_steps == 1 or micro_batch_size == -1:
            return super().get_iterator(dataset, training=training)

        kwargs = self.get_params_for('iterator_train')
        # int(): the DataLoader refuses numpy integers
        kwargs['batch_size'] = int(micro_batch_size) * int(self.acc_steps)
        return self.iterator_train(dataset, **kwargs)

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
        micro_batch_size = self.get_micro_batch_size()
        if micro_batch_size == -1 or batch_len(batch) <= micro_batch_size:
            return self.train_step_single(batch, **fit_params)

        micro_batches = split_batch(batch, micro_batch_size)
        counts = [self.count_loss_items(micro) for micro in micro_batches]
        if all(count is None for count in counts):
            # the loss is a sum: the gradients add up without rescaling
            counts, total = [1] * len(counts), 1
        elif any(count is None for count in counts):
            raise ValueError(
                "count_loss_items returned None for some micro-batches but not "
                "for others: {}".format(counts))
        else:
            counts = [float(count) for count in counts]
            total = sum(counts)

        losses, y_preds = [], []
        # .grad holds the sum over finished micro-batches j of
        # (counts[j] / unit) * gradient_j; unit changes only when the counts
        # do, so equal-sized micro-batches cost no rescaling until the end.
        unit = None
        for micro, count in zip(micro_batches, counts):
            if count == 0:  # nothing to average over: no gradient, no loss
                y_preds.append(self._infer_without_grad(micro, **fit_params))
                continue
            if unit is not None and count != unit:
                self._scale_gradients(unit / count)
            unit = count
            step = self.train_step_single(micro, **fit_params)
            losses.append(count * step['loss'].detach())
            y_preds.append(detach_outputs(step['y_pred']))
            del step  # frees the micro-batch's graph before the next forward
        if unit is not None and unit != total:
            self._scale_gradients(unit / total)

        if not losses:  # no item in the whole batch: the mean is undefined
            return {'loss': torch.tensor(float('nan')),
                    'y_pred': concat_outputs(y_preds)}
        return {
            'loss': torch.stack(losses).sum() / total,
            'y_pred': concat_outputs(y_preds),
        }

    def _infer_without_grad(self, batch, **fit_params):
        self._set_training(True)
        Xi, _ = unpack_data(batch)
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
        # This mirrors NeuralNet.train_step, except for the marked line.
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
        return step_accumulator.get_step()


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
    params.append(inspect.Parameter(
        'acc_steps', inspect.Parameter.KEYWORD_ONLY, default=1))
    params.extend(param for param in signature.parameters.values()
                  if param.kind == param.VAR_KEYWORD)
    return signature.replace(parameters=params)
