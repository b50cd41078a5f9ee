"""Data-parallel training of GradAcc nets with DistributedDataParallel.

All of the package's DDP code lives here:

* :class:`GradientSync`, used by :class:`~skorch_gradacc.GradAccMixin`
  whenever its module is wrapped in DistributedDataParallel (by
  :class:`DistributedGradAccMixin` or by skorch's ``AccelerateMixin``):
  ``no_sync()`` for every micro-batch of a group but the last, the global
  item count, and a communication hook whose all-reduce normalizes by it;
* :class:`DistributedGradAccMixin`, which wraps the module and gives the
  training iterator a DistributedSampler, for ``torchrun``.
"""

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

__all__ = ['DistributedGradAccMixin', 'GradientSync', 'gradient_sync']


class GradientSync:
    """Synchronize a group's gradient across processes once per step.

    A rank holds ``sum_j (c_j / u) * grad_j`` for its micro-batches (see
    :meth:`~skorch_gradacc.GradAccMixin.accumulate_gradients`). With
    ``factor = u / C``, ``C`` the group's item count over all ranks, the
    all-reduced sum is the gradient of the mean over the whole distributed
    group. The hook replaces DDP's default one, which averages over ranks.

    Parameters
    ----------
    module : torch.nn.parallel.DistributedDataParallel
      The wrapped module; the hook is registered on it.

    Attributes
    ----------
    factor : float
      What the next all-reduce multiplies this rank's gradient by.

    allreduces : int
      The number of gradient all-reduces so far: one per DDP bucket and
      step.

    """

    def __init__(self, module, process_group=None):
        self.module = module
        self.process_group = process_group
        self.factor = 1.0
        self.allreduces = 0
        module.register_comm_hook(self, _scaled_allreduce_hook)

    def context(self, syncs):
        """Return the context of a micro-batch's backward.

        ``no_sync()`` unless the micro-batch is the group's last (``syncs``).
        """
        return contextlib.nullcontext() if syncs else self.module.no_sync()

    def global_count(self, count):
        """Return the sum of ``count`` over all ranks."""
        total = torch.tensor([float(count)], dtype=torch.float64)
        dist.all_reduce(total, group=self.process_group)
        return total.item()


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
    """Return the :class:`GradientSync` of ``net``'s module, or None.

    None unless ``net.module_`` is wrapped in DistributedDataParallel. The
    sync is created once per wrapped module and kept in ``net.comm_state_``.
    """
    module = getattr(net, 'module_', None)
    if not isinstance(module, DistributedDataParallel):
        return None
    sync = getattr(net, 'comm_state_', None)
    if sync is None or sync.module is not module:
        sync = net.comm_state_ = GradientSync(module)
    return sync


class DistributedGradAccMixin:
    """Mixin that trains a GradAcc net with DistributedDataParallel.

    Put it in front of a GradAcc net, e.g. ``class
    DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier)``, start one
    process per rank with ``torchrun`` and call
    :func:`torch.distributed.init_process_group` before ``fit``. Then:

    * the module is wrapped in :class:`~torch.nn.parallel.
      DistributedDataParallel` (on ``device``);
    * the training iterator gets a :class:`~torch.utils.data.
      DistributedSampler`, so each rank trains on its share of every group
      (shuffled per epoch if ``iterator_train__shuffle=True``);
    * all micro-batches of a group but the last run under ``no_sync()``: one
      all-reduce per optimizer step, also for the partial group at the end
      of an epoch;
    * the all-reduce sums each rank's gradient weighted by its share of the
      group's items counted over all ranks (one more all-reduce of a single
      number per step), so the update is the single-process update with
      ``batch_size * acc_steps * world_size``, also when ranks hold different
      numbers of items in a group.

    Validation runs on every rank over the whole validation set. Every rank
    must have the same number of groups per epoch, which
    :class:`~torch.utils.data.DistributedSampler` ensures by padding. The
    history's ``train_loss`` is each rank's own mean. Like a net prepared by
    Accelerate, the net cannot be pickled while its module is wrapped; use
    ``save_params`` on one rank, or ``net.module_.module`` for the
    unwrapped module.

    The no_sync and normalization logic (:class:`GradientSync`) applies to
    any module wrapped in DistributedDataParallel, also by skorch's
    ``AccelerateMixin``.

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

    def get_iterator(self, dataset, training=False):
        """Give the training iterator a DistributedSampler."""
        iterator = super().get_iterator(dataset, training=training)
        if not training or not isinstance(iterator, DataLoader) or isinstance(
                iterator.sampler, DistributedSampler):
            return iterator
        sampler = DistributedSampler(
            iterator.dataset,
            shuffle=isinstance(iterator.sampler, RandomSampler))
        return DataLoader(
            iterator.dataset, batch_size=iterator.batch_size, sampler=sampler,
            drop_last=iterator.drop_last, collate_fn=iterator.collate_fn,
            num_workers=iterator.num_workers, pin_memory=iterator.pin_memory)

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run the epoch; a shuffling sampler draws a new order each epoch."""
        sampler = getattr(iterator, 'sampler', None)
        if training and isinstance(sampler, DistributedSampler):
            sampler.set_epoch(len(self.history))
        return super().run_single_epoch(
            iterator, training, prefix, step_fn, **fit_params)


from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin  # noqa: E402,F401,I001 (FSDP2: its own module)
