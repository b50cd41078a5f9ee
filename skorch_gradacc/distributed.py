"""Data-parallel training of GradAcc nets with DistributedDataParallel.

All of the package's data-parallel code but the sharding of the training
iterator (:mod:`skorch_gradacc.sharding`) lives here:

* :class:`StepSync`, the step protocol that
  :class:`~skorch_gradacc.GradAccMixin` follows on every rank when its
  module is wrapped for data-parallel training: this rank's groups, the
  context of each backward, the unit of the gradient before it is summed
  over ranks, and the step's one small all-reduce;
* :class:`GradientSync`, the protocol for a module wrapped in
  DistributedDataParallel (by :class:`DistributedGradAccMixin` or by
  skorch's ``AccelerateMixin``): ``no_sync()`` and a communication hook;
  another engine (e.g. FSDP2) subclasses :class:`StepSync` in the same way;
* :class:`DistributedGradAccMixin`, which wraps the module and shards the
  user's own training iterator by micro-batch, for ``torchrun``.
"""

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from skorch_gradacc.checkpoints import RankZeroCheckpointMixin
from skorch_gradacc.grouping import MicroBatchGroups
from skorch_gradacc.rank_streams import RankRandomStreamMixin
from skorch_gradacc.sharded_evaluation import ShardedEvaluationMixin
from skorch_gradacc.sharding import ShardedMicroBatchGroups

__all__ = ['DistributedGradAccMixin', 'GradientSync', 'StepSync',
           'gradient_sync']


class StepSync:
    """The step protocol of data-parallel training, on every rank.

    :class:`~skorch_gradacc.GradAccMixin` calls, for each optimizer step:

    1. :meth:`groups` once per epoch: this rank's micro-batches of each
       step, the same number of steps on every rank;
    2. :meth:`context` around each micro-batch's forward and backward,
       with ``syncs=True`` for this rank's last one of the step, whose
       backward reduces the gradient over ranks;
    3. :meth:`set_unit` just before that last micro-batch: ``.grad`` holds
       ``sum_j (c_j / u) * grad_j``, ``c_j`` the item count of micro-batch
       ``j`` (:meth:`~skorch_gradacc.GradAccMixin.count_loss_items`) and
       ``u`` the unit; the reduction must sum ``u`` times it over ranks,
       the gradient of the summed loss;
    4. :meth:`end_step` after it: one all-reduce of the step's item count,
       loss sum and rows; the summed gradient is divided by the count,
       and the step's mean loss goes to the history.

    This base class implements 1 and 4, which do not depend on the engine;
    an engine's subclass implements 2 and 3 (:class:`GradientSync` for
    DDP). The net keeps its sync in ``comm_state_``; see
    :func:`gradient_sync`.

    Parameters
    ----------
    module : torch.nn.Module
      The wrapped module.

    process_group : ProcessGroup or None
      The process group; None for the default one.

    shard : bool (default=False)
      Whether :meth:`groups` shards the training iterator by micro-batch
      (:class:`DistributedGradAccMixin`); if False, the iterator is taken
      to be sharded already (e.g. prepared by Accelerate).

    Attributes
    ----------
    device : torch.device
      Where the collectives run: the device of the module's parameters,
      which NCCL requires to be a GPU.

    """

    def __init__(self, module, process_group=None, shard=False):
        self.module = module
        self.process_group = process_group
        self.shard = shard
        param = next(module.parameters(), None)
        self.device = param.device if param is not None else torch.device(
            'cpu')

    def groups(self, micro_batches, acc_steps, keep=False,
               keep_targets=False):
        """Return this rank's groups of micro-batches, one per step.

        Every rank yields the same number of groups per epoch. With
        ``shard=True`` they are :class:`~skorch_gradacc.sharding.
        ShardedMicroBatchGroups` of the user's iterator; otherwise the
        iterator is grouped as it is, and must have a length.
        """
        sampler = getattr(micro_batches, 'sampler', None)
        if self.shard and not isinstance(sampler, DistributedSampler):
            return ShardedMicroBatchGroups(
                micro_batches, acc_steps,
                rank=dist.get_rank(self.process_group),
                world_size=dist.get_world_size(self.process_group),
                keep=keep, keep_targets=keep_targets, device=self.device,
                group=self.process_group)
        groups = MicroBatchGroups(micro_batches, acc_steps, keep=keep,
                                  keep_targets=keep_targets)
        try:
            len(groups)
        except TypeError:
            raise ValueError(
                "Data-parallel training needs a training iterator with a "
                "length when it is sharded by its own sampler, so that every "
                "rank takes the same number of steps; got {!r}.".format(
                    micro_batches)) from None
        return groups

    def context(self, syncs):
        """Return the context of a micro-batch's forward and backward."""
        raise NotImplementedError

    def set_unit(self, unit):
        """Say what this rank's gradient is in units of (None: summed)."""
        raise NotImplementedError

    def end_step(self, net, group, count, loss_sum, summed):
        """Finish the step after its last backward.

        Runs the step's one small all-reduce, and divides the summed
        gradient by the count.

        Parameters
        ----------
        net : GradAccMixin
          The net, whose learnable parameters' gradients are divided.

        group : MicroBatchGroup
          This rank's group; a :class:`~skorch_gradacc.sharding.
          ShardedGroup` learns the step's rows over all ranks.

        count : float or torch.Tensor
          This rank's item count in the step.

        loss_sum : torch.Tensor
          This rank's loss summed over its items (or its summed losses).

        summed : bool
          Whether the loss is a sum (``count_loss_items`` returns None).

        Returns
        -------
        loss : torch.Tensor
          The step's loss over all ranks, in float64 (a rank without items
          has no loss of its own to take the dtype from): the mean over its
          items, or the sum of summed losses.

        """
        values = torch.stack([
            _on_device(value, self.device)
            for value in (count, loss_sum.detach(), group.n_rows)])
        dist.all_reduce(values, group=self.process_group)
        total, loss, rows = values
        if hasattr(group, 'global_rows'):
            group.global_rows = rows
        if summed:
            return loss
        grads = [param.grad for _, param in net.get_all_learnable_params()
                 if param.grad is not None]
        # no host sync; with no item on any rank, the gradient is left as it
        # is (zero: every rank contributed nothing)
        divisor = torch.where(total > 0, total, torch.ones_like(total))
        for dtype in {grad.dtype for grad in grads}:
            torch._foreach_div_([grad for grad in grads if grad.dtype == dtype],
                                divisor.to(dtype))
        return loss / total



class GradientSync(StepSync):
    """The step protocol for a module wrapped in DistributedDataParallel.

    ``no_sync()`` for all micro-batches of a step but a rank's last, and a
    communication hook that multiplies each rank's gradient by ``factor =
    u`` (:meth:`set_unit`), making it the gradient of this rank's summed
    loss, and sums over ranks; :meth:`~StepSync.end_step` then divides by
    the step's item count over all ranks. The result is the gradient of the
    mean over the whole distributed step, as in the single process. The
    hook replaces DDP's default one, which averages over ranks.

    Parameters
    ----------
    module : torch.nn.parallel.DistributedDataParallel
      The wrapped module; the hook is registered on it.

    process_group, shard
      See :class:`StepSync`.

    Attributes
    ----------
    factor : float or torch.Tensor
      What the next all-reduce multiplies this rank's gradient by.

    allreduces : int
      The number of gradient all-reduces so far: one per DDP bucket and
      step.

    """

    def __init__(self, module, process_group=None, shard=False):
        super().__init__(module, process_group=process_group, shard=shard)
        self.factor = 1.0
        self.allreduces = 0
        module.register_comm_hook(self, _scaled_allreduce_hook)

    def context(self, syncs):
        """Return the context of a micro-batch's backward.

        ``no_sync()`` unless the micro-batch is this rank's last of the step
        (``syncs``): then the backward runs the gradient all-reduce.
        """
        return contextlib.nullcontext() if syncs else self.module.no_sync()

    def set_unit(self, unit):
        """Say what this rank's gradient is in units of.

        Called before the step's last backward on this rank.
        ``unit`` is ``u``, the count that ``.grad`` is in units of, or None
        for a summed loss (the gradient is sent as it is). A rank without
        items (``unit == 0``) contributes nothing.
        """
        self.factor = 1.0 if unit is None else unit


def _on_device(value, device):
    """Return ``value`` as a float64 scalar on ``device``, without waiting.

    A number is filled in on the device, not copied from the host.
    """
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _scaled_allreduce_hook(state, bucket):
    """Multiply this rank's bucket by ``state.factor``, then sum over ranks.

    The all-reduce runs in the calling thread and the hook returns a future
    that is already complete. A Python callback chained to an asynchronous
    all-reduce (``future.then(...)``) would run, and be freed, on one of
    gloo's worker threads a moment after the step has moved on; a process
    that exits in that moment aborts with ``terminate called without an
    active exception``, as the thread cannot take the GIL of an interpreter
    that is shutting down. With NCCL the call still returns at once: the
    all-reduce is ordered on the device's stream.
    """
    tensor = bucket.buffer()
    tensor.mul_(state.factor)
    state.allreduces += 1
    dist.all_reduce(tensor, group=state.process_group)
    future = torch.futures.Future(
        devices=[tensor.device] if tensor.is_cuda else None)
    future.set_result(tensor)
    return future


def gradient_sync(net):
    """Return the :class:`StepSync` of ``net``'s module, or None.

    The sync is kept in ``net.comm_state_``. A :class:`StepSync` that an
    engine's mixin put there for ``net.module_`` is returned as it is;
    otherwise, a module wrapped in DistributedDataParallel gets a
    :class:`GradientSync`, created once per wrapped module; any other
    module, None.
    """
    module = getattr(net, 'module_', None)
    sync = getattr(net, 'comm_state_', None)
    if isinstance(sync, StepSync) and sync.module is module:
        return sync
    if not isinstance(module, DistributedDataParallel):
        return None
    sync = net.comm_state_ = GradientSync(
        module, shard=isinstance(net, DistributedGradAccMixin))
    return sync


class DistributedGradAccMixin(RankZeroCheckpointMixin, RankRandomStreamMixin,
                              ShardedEvaluationMixin):
    """Mixin that trains a GradAcc net with DistributedDataParallel.

    Put it in front of a GradAcc net, e.g. ``class
    DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier)``, start one
    process per rank with ``torchrun`` and call
    :func:`torch.distributed.init_process_group` before ``fit``. Then:

    * the module is wrapped in :class:`~torch.nn.parallel.
      DistributedDataParallel` (on ``device``);
    * rank ``r`` of ``W`` trains on micro-batches ``r, r + W, ...`` of the
      user's own training iterator, which is not rebuilt
      (:mod:`skorch_gradacc.sharding`); all ranks draw the same shuffled
      order each epoch;
    * a step takes ``acc_steps`` micro-batches per rank; in the last step of
      an epoch a rank may have fewer, or train on zero rows, so that no row
      is repeated or dropped;
    * all micro-batches of a step but a rank's last run under ``no_sync()``:
      per optimizer step, one gradient all-reduce per DDP bucket, plus one
      all-reduce of three numbers (item count, loss sum, rows), whose count
      normalizes the summed gradient and whose loss sum makes the history's
      ``train_loss`` the mean over all ranks.

    ``W`` ranks with ``acc_steps=k`` thus train exactly like one process
    with ``acc_steps=k * W`` on the same iterator, which is plain skorch
    with ``batch_size * k * W`` for a ``batch_size`` iterator.

    Validation, ``predict``, ``predict_proba`` and ``forward`` are shared
    among the ranks by batch and gathered in order on every rank
    (:mod:`skorch_gradacc.sharded_evaluation`), so every rank records the
    single process's scores; call them on every rank. Like a net prepared by
    Accelerate, the net cannot be pickled while its module is wrapped.
    ``save_params`` (and skorch's ``Checkpoint``) writes once, from rank 0,
    with the unwrapped module's keys, so that any net loads the files;
    ``load_params`` loads on every rank
    (:class:`~skorch_gradacc.checkpoints.RankZeroCheckpointMixin`). A
    training iterator with a :class:`~torch.utils.data.DistributedSampler`
    is taken as sharded already, and its sampler's ``set_epoch`` is called
    each epoch.

    The step protocol (:class:`GradientSync`) applies to any module wrapped
    in DistributedDataParallel, also by skorch's ``AccelerateMixin``, whose
    prepared loader is sharded already.

    Attributes
    ----------
    comm_state_
      The communication hook's state (set at the first step);
      ``comm_state_.allreduces`` counts the gradient all-reduces (one per
      bucket and step).

    """

    def initialize_module(self):
        """Initialize the module and wrap it for data-parallel training."""
        super().initialize_module()
        if not isinstance(self.module_, DistributedDataParallel):
            device = torch.device(self.device) if self.device else None
            device_ids = ([device.index or 0] if device is not None
                          and device.type == 'cuda' else None)
            self.module_ = DistributedDataParallel(self.module_,
                                                   device_ids=device_ids)
        return self

    def _get_module(self, name, msg):
        # skorch's save_params and load_params read and write the module
        # through this: give them the unwrapped module, a plain net's keys
        module = super()._get_module(name, msg)
        if isinstance(module, DistributedDataParallel):
            return module.module
        return module

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run the epoch; a user's DistributedSampler gets ``set_epoch``."""
        sampler = getattr(iterator, 'sampler', None)
        if training and isinstance(sampler, DistributedSampler):
            sampler.set_epoch(len(self.history))
        return super().run_single_epoch(
            iterator, training, prefix, step_fn, **fit_params)


from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin  # noqa: E402,F401,I001 (FSDP2: its own module)
