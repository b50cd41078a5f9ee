"""Data-parallel training of GradAcc nets with DistributedDataParallel.

:class:`DistributedGradAccMixin` wraps the module and shards the user's own
training iterator by micro-batch, for ``torchrun``. What the step needs of
DDP (``no_sync()``, a communication hook, the step's all-reduce) is its
engine, :class:`skorch_gradacc.engine.DDPEngine`; the sharding of the
iterator is :mod:`skorch_gradacc.sharding`. FSDP2's mixin,
:class:`~skorch_gradacc.fully_sharded.FullyShardedGradAccMixin`, can be
imported from here as well; it is loaded only when asked for.
"""

import torch
from torch.nn.parallel import DistributedDataParallel

from skorch_gradacc.checkpoints import RankZeroCheckpointMixin
from skorch_gradacc.engine import engine_for
from skorch_gradacc.rank_streams import RankRandomStreamMixin
from skorch_gradacc.sharded_evaluation import ShardedEvaluationMixin

__all__ = ['DistributedGradAccMixin', 'FullyShardedGradAccMixin']  # noqa: F822


def __getattr__(name):
    # FSDP2 (torch.distributed.fsdp) is imported only when it is used; the
    # package imports this function too, for skorch_gradacc's own attribute
    if name == 'FullyShardedGradAccMixin':
        from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin
        return FullyShardedGradAccMixin
    raise AttributeError("module has no attribute {!r}".format(name))


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

    The engine (:class:`~skorch_gradacc.engine.DDPEngine`) serves any
    module wrapped in DistributedDataParallel, also by skorch's
    ``AccelerateMixin``, whose prepared loader is sharded already.

    Attributes
    ----------
    engine_ : skorch_gradacc.engine.DDPEngine
      The engine (set at the first step); ``engine_.allreduces`` counts the
      gradient all-reduces (one per bucket and step).

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

    def make_engine(self):
        """Return the DDP engine, which shards the training iterator."""
        return engine_for(self.module_, shard=True,
                          fp16=self.mixed_precision == 'fp16')

    def _get_module(self, name, msg):
        # skorch's save_params and load_params read and write the module
        # through this: give them the unwrapped module, a plain net's keys
        module = super()._get_module(name, msg)
        if isinstance(module, DistributedDataParallel):
            return module.module
        return module
