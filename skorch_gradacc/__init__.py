"""Exact gradient accumulation for skorch nets.

Train with the update of a large batch while holding one micro-batch at a
time: ``GradAccNeuralNetClassifier(module, batch_size=16, acc_steps=8)``
trains like ``NeuralNetClassifier(module, batch_size=128)``; the docs'
page "Memory, micro-batches and non-finite steps" says what is in memory.
"""

from skorch_gradacc.accum_grad import AccumGrad
from skorch_gradacc.batching import has_fsdp2
from skorch_gradacc.callbacks import AccumulationScheduler
from skorch_gradacc.counting import BatchNormWarning, LossItemsWarning
from skorch_gradacc.distributed import DistributedGradAccMixin
from skorch_gradacc.mixin import GradAccMixin
from skorch_gradacc.nets import (
    GradAccNeuralNet,
    GradAccNeuralNetBinaryClassifier,
    GradAccNeuralNetClassifier,
    GradAccNeuralNetRegressor,
)

__version__ = '0.1.0.dev0'


def __getattr__(name):
    # FSDP2 (torch.distributed.fsdp) is imported only when it is used
    if name == 'FullyShardedGradAccMixin':
        from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin
        return FullyShardedGradAccMixin
    raise AttributeError("module {!r} has no attribute {!r}".format(
        __name__, name))


__all__ = [
    'AccumGrad',
    'AccumulationScheduler',
    'BatchNormWarning',
    'DistributedGradAccMixin',
    'GradAccMixin',
    'GradAccNeuralNet',
    'GradAccNeuralNetBinaryClassifier',
    'GradAccNeuralNetClassifier',
    'GradAccNeuralNetRegressor',
    'LossItemsWarning',
    '__version__',
]
if has_fsdp2():  # else, `from skorch_gradacc import *` would fail
    __all__.insert(__all__.index('GradAccMixin'), 'FullyShardedGradAccMixin')
