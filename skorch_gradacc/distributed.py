"""Data-parallel training of GradAcc nets with DistributedDataParallel.

Each process (rank), started by ``torchrun``, trains on its share of every
group. Non-step micro-batches run under ``no_sync()``, so the gradients are
all-reduced once per optimizer step, not once per micro-batch, and the
all-reduce itself normalises by the group's item count over all ranks.
"""

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

__all__ = ['DistributedGradAccMixin']


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

    The no_sync and normalisation logic lives in
    :class:`~skorch_gradacc.GradAccMixin` and applies to any module wrapped
    in DistributedDataParallel, also by skorch's ``AccelerateMixin``.

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
