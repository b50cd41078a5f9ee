"""The three workloads: an MLP, a small CNN and a small transformer encoder.

Each workload is a module class plus a data generator. Data are numpy
arrays, as most skorch users pass them; nothing is downloaded (the CNN's
images are scikit-learn's bundled 8x8 digits, or synthetic images of any
size for the memory runs).
"""

import numpy as np
import torch
from sklearn.datasets import load_digits, make_classification

__all__ = ['MODELS', 'make_data', 'make_module']


class MLP(torch.nn.Module):
    """A tabular MLP: two hidden ReLU layers, logits out."""

    def __init__(self, n_in=64, n_hidden=256, n_out=10, dtype=torch.float32):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(n_in, n_hidden, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.Linear(n_hidden, n_hidden, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.Linear(n_hidden, n_out, dtype=dtype),
        )

    def forward(self, X):
        return self.layers(X)


class CNN(torch.nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a two-layer head."""

    def __init__(self, in_channels=1, image_size=8, channels=(16, 32),
                 n_hidden=64, n_out=10, dtype=torch.float32):
        super().__init__()
        c1, c2 = channels
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels, c1, 3, padding=1, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.Conv2d(c1, c2, 3, padding=1, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        n_flat = c2 * (image_size // 2) ** 2
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(n_flat, n_hidden, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.Linear(n_hidden, n_out, dtype=dtype),
        )

    def forward(self, X):
        return self.head(self.features(X))


class Transformer(torch.nn.Module):
    """A small transformer encoder that classifies token sequences.

    Token and position embeddings, ``n_layers`` pre-norm encoder layers
    without dropout (dropout draws its masks per micro-batch, see the
    package's notes), mean pooling and a linear classifier.
    """

    def __init__(self, vocab_size=64, seq_len=32, d_model=64, n_heads=4,
                 d_ff=128, n_layers=2, n_out=2, dtype=torch.float32):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab_size, d_model, dtype=dtype)
        self.positions = torch.nn.Embedding(seq_len, d_model, dtype=dtype)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=d_ff, dropout=0.0,
            batch_first=True, norm_first=True, dtype=dtype)
        self.encoder = torch.nn.TransformerEncoder(
            layer, n_layers, enable_nested_tensor=False)
        self.classifier = torch.nn.Linear(d_model, n_out, dtype=dtype)

    def forward(self, X):
        positions = torch.arange(X.shape[1], device=X.device)
        hidden = self.encoder(self.tokens(X) + self.positions(positions))
        return self.classifier(hidden.mean(dim=1))


MODELS = {
    'mlp': ('MLP on tabular data', MLP),
    'cnn': ('CNN on images', CNN),
    'transformer': ('transformer encoder on token sequences', Transformer),
}


def make_module(name, dtype=torch.float32, **module_kwargs):
    """Return ``(module class, module kwargs)`` for a skorch net."""
    _, cls = MODELS[name]
    return cls, dict(module_kwargs, dtype=dtype)


def _float(X, dtype):
    return X.astype(np.float64 if dtype == torch.float64 else np.float32)


def make_data(name, n, dtype=torch.float32, seed=0, **module_kwargs):
    """Return ``(X, y)`` numpy arrays of ``n`` samples for a workload.

    ``module_kwargs`` are the module's size parameters, so that the data fit
    the module (e.g. ``image_size`` or ``seq_len``).
    """
    rng = np.random.default_rng(seed)
    if name == 'mlp':
        n_in = module_kwargs.get('n_in', 64)
        X, y = make_classification(
            n_samples=n, n_features=n_in, n_informative=n_in // 2,
            n_classes=module_kwargs.get('n_out', 10), n_clusters_per_class=1,
            random_state=seed)
        X = (X - X.mean(0)) / X.std(0)
        return _float(X, dtype), y.astype(np.int64)
    if name == 'cnn':
        size = module_kwargs.get('image_size', 8)
        channels = module_kwargs.get('in_channels', 1)
        if size == 8 and channels == 1:
            # scikit-learn's bundled digits, repeated if more are asked for
            X, y = load_digits(return_X_y=True)
            rows = np.arange(n) % len(X)
            X = (X[rows] / 16.0).reshape(n, 1, 8, 8)
            return _float(X, dtype), y[rows].astype(np.int64)
        X = rng.standard_normal((n, channels, size, size), dtype=np.float32)
        y = rng.integers(0, module_kwargs.get('n_out', 10), size=n)
        return _float(X, dtype), y.astype(np.int64)
    if name == 'transformer':
        vocab = module_kwargs.get('vocab_size', 64)
        seq_len = module_kwargs.get('seq_len', 32)
        X = rng.integers(0, vocab, size=(n, seq_len))
        # a label that needs the whole sequence: more 1s than 2s?
        y = ((X == 1).sum(1) > (X == 2).sum(1)).astype(np.int64)
        return X.astype(np.int64), y
    raise ValueError('unknown workload {!r}'.format(name))
