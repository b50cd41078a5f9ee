"""Fully sharded data-parallel training (FSDP2) of GradAcc nets.

:class:`FullyShardedGradAccMixin` shards the module's parameters, gradients
and optimizer state over the ranks with PyTorch's
:func:`torch.distributed.fsdp.fully_shard`, for models that do not fit one
device together with their gradients and optimizer state. In one place
each:

* which submodules become FSDP units: :func:`shard_module`;
* the step's micro-batches, their reduce-scatters and the normalization by
  the global item count:
  :meth:`FullyShardedGradAccMixin._accumulate_gradients`;
* one full, unsharded checkpoint, written by rank 0 and read by every
  rank: :meth:`FullyShardedGradAccMixin._checkpoint_states` (with
  :class:`~skorch_gradacc.checkpoints.RankZeroCheckpointMixin`), and skorch's own
  ``save_params`` and ``load_params`` through
  :meth:`FullyShardedGradAccMixin._get_module`.
"""

import contextlib

import torch
import torch.distributed as dist
from skorch.utils import _check_f_arguments
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from skorch_gradacc.batching import batch_len, concat_outputs, detach_outputs
from skorch_gradacc.checkpoints import RankZeroCheckpointMixin
from skorch_gradacc.distributed import StepSync, gradient_sync
from skorch_gradacc.rank_streams import RankRandomStreamMixin
from skorch_gradacc.sharded_evaluation import ShardedEvaluationMixin
from skorch_gradacc.sharding import ShardedMicroBatchGroups, zero_rows

__all__ = ['FullyShardedGradAccMixin', 'FullyShardedSync', 'shard_module']

#: Classes that are FSDP units by default, wherever they are in the module.
TRANSFORMER_BLOCKS = (torch.nn.TransformerEncoderLayer,
                      torch.nn.TransformerDecoderLayer)


def _matches(module, shard_classes):
    return any(isinstance(module, cls) if isinstance(cls, type)
               else type(module).__name__ == cls for cls in shard_classes)


def _has_params(module):
    return next(module.parameters(), None) is not None


def default_shard_classes(module):
    """Return the classes whose instances :func:`shard_module` shards.

    The block classes a Hugging Face model names in ``_no_split_modules``
    (as Accelerate's transformer auto-wrap policy reads them), and
    PyTorch's :class:`~torch.nn.TransformerEncoderLayer` and
    :class:`~torch.nn.TransformerDecoderLayer`.
    """
    names = set()
    for sub in module.modules():
        names.update(getattr(sub, '_no_split_modules', None) or ())
    return TRANSFORMER_BLOCKS + tuple(sorted(names))


def units_of(module, shard_classes=None):
    """Return the submodules of ``module`` that become FSDP units.

    With ``shard_classes`` given (classes or class names), every outermost
    submodule of one of them. Otherwise the transformer blocks of
    :func:`default_shard_classes`, if the module has any, else every member
    holding parameters of a :class:`torch.nn.Sequential` or
    :class:`torch.nn.ModuleList` (each layer of a plain ``Sequential``),
    outermost first. The root is not included.
    """
    explicit = shard_classes is not None
    classes = tuple(shard_classes) if explicit else default_shard_classes(module)
    units = []

    def visit(parent, containers):
        for child in parent.children():
            if _matches(child, classes) or (
                    containers and isinstance(parent, (torch.nn.Sequential,
                                                       torch.nn.ModuleList))
                    and _has_params(child)):
                units.append(child)
            else:
                visit(child, containers)

    visit(module, containers=False)
    if not units and not explicit:
        visit(module, containers=True)
    return units


def shard_module(module, shard_classes=None, **kwargs):
    """Apply :func:`~torch.distributed.fsdp.fully_shard` to a module, in place.

    Each unit of :func:`units_of` is sharded first, then the root, so that
    one unit's parameters are gathered at a time in the forward and
    backward passes. Every FSDP module gets a gradient divide factor of 1
    and sum-only reductions: the reduce-scatter sums the ranks' gradients
    (the divide factor of the root does not reach the inner units, and
    ``ReduceOp.PREMUL_SUM`` is refused by gloo).

    Parameters
    ----------
    module : torch.nn.Module
      The module; ``fully_shard`` moves each unit to the mesh's device as
      it shards it.

    shard_classes : sequence of classes or class names, or None
      See :func:`units_of`.

    **kwargs
      Passed on to ``fully_shard`` (``mesh``, ``mp_policy``, ...).

    Returns
    -------
    module : torch.nn.Module
      The same object, now an ``FSDPModule``.

    """
    for unit in units_of(module, shard_classes):
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


class _Steps:
    """The groups of micro-batches of this rank, one per step, with passes.

    Each group gets ``passes``: the number of micro-batches of the rank
    with the most in the step, which every rank runs. For the groups of
    :class:`~skorch_gradacc.sharding.ShardedMicroBatchGroups` that is rank
    0's share of the step; for a loader sharded by its own sampler (a
    :class:`~torch.utils.data.DistributedSampler`, which pads), the group's
    size.
    """

    def __init__(self, groups, micro_batches, acc_steps, world_size):
        self.groups = groups
        self.count = len(micro_batches)
        self.world_size = world_size
        self.per_step = acc_steps * world_size

    def __len__(self):
        return len(self.groups)

    def __iter__(self):
        sharded = isinstance(self.groups, ShardedMicroBatchGroups)
        for step, group in enumerate(self.groups):
            items = min(self.per_step, self.count - step * self.per_step)
            group.passes = (-(-items // self.world_size) if sharded
                            else group.size)
            yield group


class FullyShardedSync(StepSync):
    """The step protocol for a module sharded with ``fully_shard`` (FSDP2).

    :meth:`~skorch_gradacc.distributed.StepSync.groups` and
    :meth:`~skorch_gradacc.distributed.StepSync.end_step` are those of
    every engine: the user's iterator sharded by micro-batch, and one
    all-reduce of the step's item count, loss sum and rows, after which the
    summed gradient (here: this rank's shard of it) is divided by the
    count. Here, each group also learns its ``passes``, and
    :meth:`context` turns FSDP's reduce-scatter on or off.

    Parameters
    ----------
    module : torch.nn.Module
      The module, sharded by ``fully_shard``.

    process_group : ProcessGroup or None
      The process group; None for the default one.

    """

    def __init__(self, module, process_group=None):
        super().__init__(module, process_group=process_group, shard=True)

    def groups(self, micro_batches, acc_steps, keep=False,
               keep_targets=False):
        """Return this rank's groups, each with its number of ``passes``."""
        try:
            len(micro_batches)
        except TypeError:
            raise ValueError(
                "FullyShardedGradAccMixin needs a training iterator with a "
                "length, so that every rank knows how many forward passes each "
                "step takes; got {!r}.".format(micro_batches)) from None
        return _Steps(super().groups(micro_batches, acc_steps, keep=keep,
                                     keep_targets=keep_targets),
                      micro_batches, acc_steps,
                      dist.get_world_size(self.process_group))

    def context(self, syncs):
        """Reduce-scatter in this backward if ``syncs``, else accumulate."""
        self.module.set_requires_gradient_sync(syncs)
        return contextlib.nullcontext()

    def set_unit(self, unit):
        """Check that the gradient is that of the summed loss.

        FSDP2 offers no hook to scale a rank's gradient before its
        reduce-scatter, so the net weights each micro-batch's backward by
        its item count instead: ``.grad`` is in units of one item (1), or of
        a summed loss (None).
        """
        if unit not in (None, 1.0):
            raise ValueError(
                "FullyShardedSync sums gradients of summed losses; got "
                "unit={!r}.".format(unit))


class FullyShardedGradAccMixin(RankZeroCheckpointMixin,
                               RankRandomStreamMixin,
                               ShardedEvaluationMixin):
    """Mixin that trains a GradAcc net with fully sharded data parallel.

    Put it in front of a GradAcc net, e.g. ``class
    FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier)``, start
    one process per rank with ``torchrun`` and call
    :func:`torch.distributed.init_process_group` before ``fit``. Use it
    instead of :class:`~skorch_gradacc.DistributedGradAccMixin` when the
    model, its gradients and its optimizer state do not fit on one device:
    each rank holds ``1 / world_size`` of each, and gathers one unit's
    parameters at a time for the forward and backward passes.

    * The module is sharded in place with
      :func:`torch.distributed.fsdp.fully_shard`: each unit (see
      ``shard_classes``), then the root. The optimizer is built on the
      sharded parameters.
    * The training iterator is the user's own, sharded by micro-batch:
      rank ``r`` takes micro-batches ``r, r + W, r + 2W, ...``
      (:mod:`skorch_gradacc.sharding`, as with
      :class:`~skorch_gradacc.DistributedGradAccMixin`). So ``W`` ranks
      with ``acc_steps=k`` train like one process with ``acc_steps=k * W``
      on the same iterator. A rank with fewer micro-batches in the last
      step runs zero-row forward and backward passes instead, which add
      nothing, so that every rank runs as many passes. The iterator needs a
      length.
    * Each micro-batch's backward computes the gradient of its loss times
      its item count (:meth:`count_loss_items`), the loss itself is
      untouched; the reduce-scatter sums over the ranks. By default the
      gradients stay unsharded and local until the group's last micro-batch
      (``set_requires_gradient_sync(False)``), which reduce-scatters once
      per step. After it, one all-reduce of three numbers (the step's item
      count, loss sum and rows over all ranks, as in
      :class:`~skorch_gradacc.distributed.GradientSync`) gives the count
      ``C``, and each rank divides its gradient shard by ``C``: the update
      is that of the single process with ``batch_size * acc_steps *
      world_size``, and the history's ``train_loss`` and
      ``train_batch_size`` are those of the whole step over all ranks.
    * ``save_params`` and ``load_params``, called on every rank, write and
      read one full, unsharded checkpoint, in the format of a plain net;
      rank 0 writes.

    Every forward pass gathers parameters from all ranks, so every rank must
    take part in every forward pass: in training and validation (the mixin
    sees to it; validation is shared among the ranks, see
    :mod:`skorch_gradacc.sharded_evaluation`), and in ``predict``, which
    must be called on every rank. Options that would let
    the ranks run different numbers of forward passes (``micro_batch_size``)
    or take different decisions about a step (``skip_nonfinite``) are
    refused. Only the module (``module_``) is sharded; the optimizer must
    hold its parameters only.

    The net's ``mixed_precision='bf16'`` becomes FSDP's
    :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`: parameters are
    gathered and used in bfloat16, gradients reduced in float32 and the
    sharded parameters kept in their own dtype, and no autocast is used.
    ``mixed_precision='fp16'`` is refused.

    .. note::

       Tested with 2 ranks on the CPU (gloo). GPUs (NCCL) are untested.

    Parameters
    ----------
    shard_classes : sequence of classes or class names, or None (default=None)
      The submodule classes whose instances each become an FSDP unit, e.g.
      the transformer block. By default: the classes a Hugging Face model
      names in ``_no_split_modules`` and PyTorch's transformer layers, or,
      for a model without them, every member holding parameters of a
      :class:`torch.nn.Sequential` or :class:`torch.nn.ModuleList` (the
      layers of a plain ``Sequential``). The root is always sharded too.

    sync_each_batch : bool (default=False)
      If False, gradients are reduce-scattered once per optimizer step, on
      the group's last micro-batch; until then each rank holds the
      unsharded gradient. If True, every micro-batch's gradient is
      reduce-scattered, so that only the shards accumulate: less memory,
      ``acc_steps`` times the communication (Accelerate's
      ``sync_each_batch``). Both give the same update.

    Examples
    --------
    >>> from skorch_gradacc import GradAccNeuralNetClassifier
    >>> class FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    ...     '''GradAcc classifier with FSDP2, to be run under torchrun'''
    >>> net = FSDPNet(torch.nn.Linear, module__in_features=4,
    ...               module__out_features=2, acc_steps=4,
    ...               shard_classes=['Linear'])
    >>> net.shard_classes
    ['Linear']

    """

    def __init__(self, *args, shard_classes=None, sync_each_batch=False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.shard_classes = shard_classes
        self.sync_each_batch = sync_each_batch

    # Validation

    def _check_fsdp_params(self):
        if not isinstance(self.sync_each_batch, bool):
            raise ValueError(
                "sync_each_batch must be True or False, got {!r} instead."
                .format(self.sync_each_batch))
        classes = self.shard_classes
        if classes is not None and (
                isinstance(classes, (str, type)) or not all(
                    isinstance(cls, (str, type)) for cls in classes)):
            raise ValueError(
                "shard_classes must be None or a list of module classes or "
                "class names, got {!r} instead.".format(classes))
        if self.micro_batch_size is not None:
            raise ValueError(
                "micro_batch_size must be None with FullyShardedGradAccMixin, "
                "got {!r}: every rank must run the same forward passes."
                .format(self.micro_batch_size))
        if self.skip_nonfinite:
            raise ValueError(
                "skip_nonfinite must be False with FullyShardedGradAccMixin, "
                "got True: each rank sees only its own gradient shard.")
        if self.mixed_precision not in (None, 'bf16'):
            raise ValueError(
                "mixed_precision must be None or 'bf16' with "
                "FullyShardedGradAccMixin, got {!r}: 'bf16' uses FSDP's "
                "MixedPrecisionPolicy, and 'fp16' would need a sharded "
                "GradScaler.".format(self.mixed_precision))
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedGradAccMixin needs the default process group: "
                "start the script with torchrun and call "
                "torch.distributed.init_process_group() before initializing "
                "the net.")

    def _validate_params(self):
        super()._validate_params()
        self._check_fsdp_params()

    def check_training_readiness(self):
        """Check that the net is ready to train, its FSDP options included."""
        super().check_training_readiness()
        if getattr(self, 'initialized_', False):
            self._check_fsdp_params()

    # Initialization

    def _mesh(self):
        device = torch.device(self.device) if self.device else torch.device('cpu')
        if device.type == 'cuda':
            torch.cuda.set_device(device)
        return init_device_mesh(device.type, (dist.get_world_size(),))

    def initialize_module(self):
        """Initialize the module and shard it with ``fully_shard``."""
        self._check_fsdp_params()
        super().initialize_module()
        if isinstance(self.module_, FSDPModule):
            self.comm_state_ = FullyShardedSync(self.module_)
            return self
        # fully_shard moves each unit to the mesh's device as it shards it,
        # so that the whole module never has to fit there
        kwargs = {'mesh': self._mesh()}
        if self.mixed_precision == 'bf16':
            kwargs['mp_policy'] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.module_ = shard_module(self.module_, self.shard_classes, **kwargs)
        self.comm_state_ = FullyShardedSync(self.module_)
        return self

    def _autocast(self):
        # mixed_precision='bf16' is FSDP's MixedPrecisionPolicy, not autocast
        return contextlib.nullcontext()

    # The step

    def _step_pieces(self, group):
        """Yield ``(micro_batch, is_last)`` for ``group.passes`` passes.

        This rank's micro-batches of the step, then zero-row ones until the
        step has as many forward and backward passes as on the rank with the
        most: every pass gathers parameters from all ranks.
        """
        template, pulled = None, 0
        for index, micro in enumerate(group.micro_batches()):
            if index >= group.passes:
                raise RuntimeError(
                    "The training iterator yielded more micro-batches than its "
                    "length says; its sampler's __len__ must match what it "
                    "yields.")
            if template is None:
                template = zero_rows(micro)
            group.rows_in_flight = batch_len(micro)
            pulled += 1
            yield micro, index == group.passes - 1
            del micro
        for index in range(pulled, group.passes):
            yield template, index == group.passes - 1

    def _accumulate_gradients(self, group, **fit_params):
        """Run the step's passes; reduce-scatter; normalize globally.

        ``.grad`` ends as this rank's shard of the gradient of the mean loss
        over the step's items on all ranks. Unlike
        :class:`~skorch_gradacc.GradAccMixin`, which rescales ``.grad``
        whenever the item count changes, each backward is weighted by its
        count: FSDP2 keeps the unsharded gradient of a step in progress out
        of reach, and a micro-batch without items must still run its pass.
        See the class docstring.
        """
        sync = gradient_sync(self)
        keep_y_pred = getattr(self, 'keep_train_y_pred_', False)
        losses, y_preds = [], []
        summed = None  # whether the loss is a sum (count_loss_items is None)
        total = 0.0  # the step's item count on this rank
        for piece, is_last in self._step_pieces(group):
            count = self.count_loss_items(piece)
            if summed is None:
                summed = count is None
            elif summed != (count is None):
                raise ValueError(
                    "count_loss_items returned None for some micro-batches "
                    "but not for others; got {!r}.".format(count))
            weight = 1.0 if summed else float(count)
            total += weight
            if is_last:  # this backward reduce-scatters the step's sum
                sync.set_unit(None if summed else 1.0)
            self.loss_weight_, self.loss_weighted_ = weight, False
            try:
                with sync.context(is_last or self.sync_each_batch):
                    step = self.train_step_single(piece, **fit_params)
            finally:
                self.loss_weight_ = None
            if not self.loss_weighted_:
                raise RuntimeError(
                    "FullyShardedGradAccMixin weights each micro-batch's "
                    "gradient in get_loss; an override of train_step_single "
                    "must compute the loss with self.get_loss(..., "
                    "training=True), and an override of get_loss must call "
                    "super().get_loss.")
            if weight and batch_len(piece):  # zero rows: the loss may be NaN
                losses.append(weight * step['loss'].detach())
            if keep_y_pred and batch_len(piece):
                y_preds.append(detach_outputs(step['y_pred']))
            del step, piece  # frees the piece's graph and outputs

        loss_sum = torch.stack(losses).sum() if losses else torch.zeros(())
        # the step's one small all-reduce; the gradient shards are divided
        loss = sync.end_step(self, group, total, loss_sum, summed)
        y_pred = None
        if y_preds:
            y_pred = y_preds[0] if len(y_preds) == 1 else concat_outputs(y_preds)
        return {'loss': loss, 'y_pred': y_pred}

    # Checkpoints: one full, unsharded copy

    def _is_sharded(self, attr):
        return attr == 'module_' or attr[:-1] in self._optimizers

    def _get_module(self, name, msg):
        # skorch's save_params and load_params read and write the module and
        # the optimizers through this: give them the full, unsharded state
        module = super()._get_module(name, msg)
        if self._is_sharded(name) and isinstance(self.module_, FSDPModule):
            return _FullState(self, name)
        return module

    def _full_state_dict(self, attr):
        """Gather the full state of ``module_`` or an optimizer (collective)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if attr == 'module_':
            return get_model_state_dict(self.module_, options=options)
        optimizer = getattr(self, attr)
        state = get_optimizer_state_dict(self.module_, optimizer, options=options)
        if not state:  # cpu_offload: only rank 0 gets the full state
            return state
        # the format of a plain optimizer: parameters by their position
        index = {name: i for i, name in enumerate(self._param_names(optimizer))}
        return {
            'state': {index[name]: value
                      for name, value in state['state'].items()},
            'param_groups': [dict(group, params=[index[name]
                                                 for name in group['params']])
                             for group in state['param_groups']],
        }

    def _param_names(self, optimizer):
        names = {param: name for name, param in self.module_.named_parameters()}
        return [names[param] for group in optimizer.param_groups
                for param in group['params']]

    def _load_full_state_dict(self, attr, state_dict):
        """Shard a full state dict into ``module_`` or an optimizer."""
        options = StateDictOptions(full_state_dict=True)
        if attr == 'module_':
            set_model_state_dict(self.module_, state_dict, options=options)
            return
        optimizer = getattr(self, attr)
        names = self._param_names(optimizer)
        state_dict = {
            'state': {names[i]: value
                      for i, value in state_dict['state'].items()},
            'param_groups': [dict(group, params=[names[i]
                                                 for i in group['params']])
                             for group in state_dict['param_groups']],
        }
        set_optimizer_state_dict(self.module_, optimizer, state_dict,
                                 options=options)

    save_needs_every_rank = True  # the full states are gathered

    @contextlib.contextmanager
    def _checkpoint_states(self, files):
        """Gather the full states to save from all ranks (collective)."""
        modules, _ = _check_f_arguments('save_params', **files)
        if getattr(self, 'initialized_', False):
            # a root with parameters of its own stays unsharded after a
            # forward pass without backward (validation, predict); the
            # optimizer holds the sharded ones
            for module in self.module_.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        self.full_states_ = {
            attr: self._full_state_dict(attr) for attr in modules
            if self._is_sharded(attr) and getattr(self, 'initialized_', False)}
        try:
            yield
        finally:
            self.full_states_ = None

    def get_loss(self, y_pred, y_true, X=None, training=False):
        """Return the loss; in training its gradient is weighted by its count.

        The value is the loss itself; ``backward`` computes the gradient of
        the loss times the micro-batch's item count, so that the
        reduce-scatter sums comparable gradients over the ranks.
        """
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        weight = getattr(self, 'loss_weight_', None) if training else None
        if weight is None:
            return loss
        self.loss_weighted_ = True
        if weight == 0:
            # no items (e.g. zero rows): a zero gradient through every unit,
            # so that each one reduce-scatters, not the loss's, maybe NaN
            weighted = sum(0 * out.sum() for out in _tensors(y_pred))
        else:
            weighted = loss * weight
        return loss.detach() + (weighted - weighted.detach())


class _FullState:
    """The full state dict of a sharded module or optimizer.

    What skorch's ``save_params`` and ``load_params`` see of it; loading
    shards the state again, on every rank.
    """

    def __init__(self, net, attr):
        self.net = net
        self.attr = attr

    def state_dict(self):
        return self.net.full_states_[self.attr]

    def load_state_dict(self, state_dict):
        self.net._load_full_state_dict(self.attr, state_dict)


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
