"""skorch's net classes with gradient accumulation.

Each is :class:`skorch_gradacc.GradAccMixin` in front of skorch's class of
the same name; its docstring lists the mixin's parameters.
"""

from skorch import (
    NeuralNet,
    NeuralNetBinaryClassifier,
    NeuralNetClassifier,
    NeuralNetRegressor,
)

from skorch_gradacc.mixin import GradAccMixin
from skorch_gradacc.params import params_doc

__all__ = [
    'GradAccNeuralNet',
    'GradAccNeuralNetBinaryClassifier',
    'GradAccNeuralNetClassifier',
    'GradAccNeuralNetRegressor',
]


class GradAccNeuralNet(GradAccMixin, NeuralNet):
    """:class:`skorch.NeuralNet` with gradient accumulation.

    Takes the parameters of :class:`skorch.NeuralNet` and these:

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> X = np.random.randn(64, 3).astype(np.float32)
    >>> y = X.sum(1, keepdims=True)
    >>> net = GradAccNeuralNet(torch.nn.Linear, module__in_features=3,
    ...                        module__out_features=1,
    ...                        criterion=torch.nn.MSELoss, batch_size=4,
    ...                        acc_steps=4, max_epochs=1, verbose=0)
    >>> net.fit(X, y).history[-1, 'batches', 0, 'train_batch_size']
    16

    """


class GradAccNeuralNetClassifier(GradAccMixin, NeuralNetClassifier):
    """:class:`skorch.NeuralNetClassifier` with gradient accumulation.

    Takes the parameters of :class:`skorch.NeuralNetClassifier` and these:

    Examples
    --------
    >>> import numpy as np
    >>> from skorch.toy import make_classifier
    >>> X = np.random.randn(100, 20).astype(np.float32)
    >>> y = np.random.randint(0, 2, size=100)
    >>> net = GradAccNeuralNetClassifier(make_classifier(), batch_size=16,
    ...                                  acc_steps=8, max_epochs=2, verbose=0)
    >>> net.fit(X, y).predict(X).shape
    (100,)

    """


class GradAccNeuralNetBinaryClassifier(GradAccMixin, NeuralNetBinaryClassifier):
    """:class:`skorch.NeuralNetBinaryClassifier` with gradient accumulation.

    Takes the parameters of :class:`skorch.NeuralNetBinaryClassifier` and
    these:

    Examples
    --------
    >>> from skorch.toy import make_binary_classifier
    >>> net = GradAccNeuralNetBinaryClassifier(
    ...     make_binary_classifier(output_units=1), batch_size=8, acc_steps=2)

    """


class GradAccNeuralNetRegressor(GradAccMixin, NeuralNetRegressor):
    """:class:`skorch.NeuralNetRegressor` with gradient accumulation.

    Takes the parameters of :class:`skorch.NeuralNetRegressor` and these:

    Examples
    --------
    >>> from skorch.toy import make_regressor
    >>> net = GradAccNeuralNetRegressor(make_regressor(), batch_size=8,
    ...                                 acc_steps=4)

    """


for _net in (GradAccNeuralNet, GradAccNeuralNetClassifier,
             GradAccNeuralNetBinaryClassifier, GradAccNeuralNetRegressor):
    _net.__doc__ = _net.__doc__.replace(
        '\n    Examples\n', params_doc(GradAccMixin) + '\n    Examples\n', 1)
del _net
