"""What the Dask workers of ``tests/test_dask.py`` must be able to import.

A worker process unpickles a net, its module class and the functions it is
asked to run by reference (module and qualified name), so they cannot live in
the test file: the workers import this module instead (``test_dask.py``
uploads it with ``Client.upload_file``). It imports neither pytest nor
distributed.
"""

import os

import numpy as np
import torch
from sklearn.datasets import make_classification

from skorch_gradacc import GradAccNeuralNetClassifier

DTYPE = torch.float64


class MLP(torch.nn.Module):
    """A small float64 MLP with softmax output."""

    def __init__(self, n_in=10, n_hidden=16, n_out=3):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, n_hidden, dtype=DTYPE)
        self.output = torch.nn.Linear(n_hidden, n_out, dtype=DTYPE)

    def forward(self, X):
        return torch.softmax(self.output(torch.tanh(self.hidden(X))), dim=-1)


class SeededNet(GradAccNeuralNetClassifier):
    """Seeds torch at the start of every fit.

    Initialization and the shuffling of the training data then depend only
    on the hyper-parameters, not on what the process ran before, so a search
    gives the same scores on any worker as in a serial run.
    """

    def initialize(self):
        torch.manual_seed(0)
        return super().initialize()


def make_data(n_samples=150, seed=0):
    X, y = make_classification(
        n_samples=n_samples, n_features=10, n_informative=6, n_classes=3,
        random_state=seed)
    return X.astype(np.float64), y.astype(np.int64)


def make_net(**kwargs):
    kwargs.setdefault('batch_size', 8)
    kwargs.setdefault('max_epochs', 2)
    kwargs.setdefault('lr', 0.1)
    kwargs.setdefault('train_split', None)
    kwargs.setdefault('iterator_train__shuffle', True)
    kwargs.setdefault('verbose', 0)
    return SeededNet(MLP, **kwargs)


def fit_in_worker(net, X, y):
    """Fit ``net``; return it and the id of the process that fitted it."""
    return net.fit(X, y), os.getpid()


def predict_proba_in_worker(net, X):
    """Return the predicted probabilities, ``acc_steps`` and the process id."""
    return net.predict_proba(X), net.acc_steps, os.getpid()
