"""What the benchmarks train: three workloads and the ways to train them.

An MLP, a small CNN (on scikit-learn's 8x8 digits, or synthetic images) and a
small transformer encoder. The contenders (``suite.CONTENDERS``) share SGD with
momentum, shuffled data, no validation split and ``CrossEntropyLoss``, and differ
only in how they accumulate. ``naive`` is ``loss / k`` with the last partial
group stepped anyway, the rule of Lightning and most loops.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits, make_classification
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin

from skorch_gradacc import AccumGrad, GradAccNeuralNetClassifier
from skorch_gradacc.demo import NaiveDivideByK


def mlp(n_in=64, n_hidden=256, n_out=10, n_layers=2, dtype=torch.float32):
    """An MLP: ``n_layers`` hidden ReLU layers, logits out."""
    layers, width = [], n_in
    for _ in range(n_layers):
        layers += [torch.nn.Linear(width, n_hidden, dtype=dtype), torch.nn.ReLU()]
        width = n_hidden
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, n_out, dtype=dtype))


def cnn(in_channels=1, image_size=8, channels=(16, 32), n_hidden=64, n_out=10,
        dtype=torch.float32):
    """Two 3x3 convolutions, a 2x2 max-pool and a two-layer head."""
    c1, c2 = channels
    return torch.nn.Sequential(
        torch.nn.Conv2d(in_channels, c1, 3, padding=1, dtype=dtype), torch.nn.ReLU(),
        torch.nn.Conv2d(c1, c2, 3, padding=1, dtype=dtype), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(c2 * (image_size // 2) ** 2, n_hidden, dtype=dtype),
        torch.nn.ReLU(), torch.nn.Linear(n_hidden, n_out, dtype=dtype))


class Transformer(torch.nn.Module):
    """A small transformer encoder that classifies token sequences: token and
    position embeddings, ``n_layers`` pre-norm encoder layers without dropout
    (it draws its masks per micro-batch), mean pooling, a linear classifier."""

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


WORKLOADS = {'mlp': mlp, 'cnn': cnn, 'transformer': Transformer}


def make_workload(name, cfg, n=None, dtype=torch.float32):
    """``(X, y, module factory, module kwargs)``: ``cfg['n']`` (or ``n``) rows of
    numpy data that fit the module of ``cfg['module_kwargs']``."""
    module, kwargs = WORKLOADS[name], cfg.get('module_kwargs', {})
    n = cfg['n'] if n is None else n
    floats = np.float64 if dtype == torch.float64 else np.float32
    rng = np.random.default_rng(0)
    size, channels = kwargs.get('image_size', 8), kwargs.get('in_channels', 1)
    if name == 'mlp':
        n_in = kwargs.get('n_in', 64)
        X, y = make_classification(
            n_samples=n, n_features=n_in, n_informative=n_in // 2,
            n_classes=kwargs.get('n_out', 10), n_clusters_per_class=1,
            random_state=0)
        X = ((X - X.mean(0)) / X.std(0)).astype(floats)
    elif name == 'cnn' and size == 8 and channels == 1:
        # scikit-learn's bundled digits, repeated if more are asked for
        X, y = load_digits(return_X_y=True)
        rows = np.arange(n) % len(X)
        X, y = (X[rows] / 16.0).reshape(n, 1, 8, 8).astype(floats), y[rows]
    elif name == 'cnn':
        X = rng.standard_normal((n, channels, size, size), dtype=np.float32)
        X, y = X.astype(floats), rng.integers(0, kwargs.get('n_out', 10), size=n)
    else:
        X = rng.integers(0, kwargs.get('vocab_size', 64),
                         size=(n, kwargs.get('seq_len', 32)))
        # a label that needs the whole sequence: more 1s than 2s?
        y = (X == 1).sum(1) > (X == 2).sum(1)
    return X, y.astype(np.int64), module, dict(kwargs, dtype=dtype)


class FAQRecipeNet(NeuralNetClassifier):
    """skorch's FAQ recipe for gradient accumulation ("How can I perform
    gradient accumulation with skorch?"), in skorch 1.x's ``train_step``
    signature, exactly as skorch's test ``test_gradient_accumulation`` writes
    it. Nothing else is changed or fixed."""

    def __init__(self, *args, acc_steps=2, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps

    def get_loss(self, *args, **kwargs):
        loss = super().get_loss(*args, **kwargs)
        return loss / self.acc_steps  # normalize loss

    def train_step(self, batch, **fit_params):
        # note that n_train_batches starts at 1 for each epoch
        n_train_batches = len(self.history[-1, 'batches'])
        step = self.train_step_single(batch, **fit_params)

        if n_train_batches % self.acc_steps == 0:
            self.optimizer_.step()
            self.optimizer_.zero_grad()
        return step


class AccelerateNet(AccelerateMixin, NeuralNetClassifier):
    """``NeuralNetClassifier`` trained through Hugging Face Accelerate."""


def make_net(kind, module, module_kwargs, batch_size, acc_steps=1, lr=0.05,
             max_epochs=1, **kwargs):
    """A skorch contender: ``'plain'``, ``'gradacc'``, ``'faq'``, ``'naive'`` or
    ``'accelerate'``; build the latter right before it trains: all ``Accelerator``
    objects share ``gradient_accumulation_steps``, and the last one sets it."""
    params = dict(criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.SGD,
                  optimizer__momentum=0.9, lr=lr, max_epochs=max_epochs,
                  batch_size=batch_size, train_split=None,
                  iterator_train__shuffle=True, verbose=0)
    params.update({'module__' + key: value for key, value in module_kwargs.items()},
                  **kwargs)
    if kind == 'accelerate':
        from accelerate import Accelerator

        # AccelerateMixin logs through accelerator.print, which ignores
        # verbose=0; skorch's print keeps the run as quiet as the others
        params.setdefault('callbacks__print_log__sink', print)
        return AccelerateNet(module, accelerator=Accelerator(
            gradient_accumulation_steps=acc_steps, cpu=True), device=None,
            unwrap_after_train=False, **params)
    if kind == 'plain':
        return NeuralNetClassifier(module, **params)
    return {'gradacc': GradAccNeuralNetClassifier, 'faq': FAQRecipeNet,
            'naive': NaiveDivideByK}[kind](module, acc_steps=acc_steps, **params)


class HandLoop:
    """The loop everyone writes (and Accelerate's docs show): backward on ``loss
    / k``, step every ``k`` micro-batches and after the last; no callbacks or
    history, the floor for an epoch's time. ``loader`` yields ``(X, y)``."""

    def __init__(self, module, loader, acc_steps, lr=0.05):
        self.module, self.loader, self.acc_steps = module, loader, acc_steps
        self.criterion = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)

    @classmethod
    def from_arrays(cls, module, X, y, batch_size, acc_steps):
        dataset = torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(y))
        return cls(module, torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=True), acc_steps)

    def epoch(self):
        self.module.train()
        for i, (Xi, yi) in enumerate(self.loader, start=1):
            loss = self.criterion(self.module(Xi), yi)
            (loss / self.acc_steps).backward()
            if i % self.acc_steps == 0 or i == len(self.loader):
                self.optimizer.step()
                self.optimizer.zero_grad()


class AccumGradLoop(HandLoop):
    """The same loop with :class:`skorch_gradacc.AccumGrad`, no ``loss / k``:
    each micro-batch's rows are counted (``set_count``), so a short last
    micro-batch weighs what it holds, and the last partial group is flushed."""

    def __init__(self, module, loader, acc_steps):
        super().__init__(module, loader, acc_steps)
        self.optimizer = AccumGrad(self.optimizer, acc_steps)

    def epoch(self):
        self.module.train()
        for Xi, yi in self.loader:
            self.optimizer.zero_grad()
            self.optimizer.set_count(len(yi))
            self.criterion(self.module(Xi), yi).backward()
            self.optimizer.step()
        self.optimizer.flush()
