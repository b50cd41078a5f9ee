"""The ways to train that the benchmarks compare.

* ``plain``: skorch's ``NeuralNetClassifier``, at ``B`` or at ``B * k``.
* ``gradacc``: this package's ``GradAccNeuralNetClassifier(B, k)``.
* ``faq``: skorch's FAQ recipe, :class:`FAQRecipeNet`.
* ``accelerate``: ``skorch.hf.AccelerateMixin`` with Accelerate's own
  accumulation, :class:`AccelerateNet`.
* ``naive``: ``loss / k`` with the last partial group stepped anyway, the
  rule of Lightning and most loops (the demo's ``NaiveDivideByK``).
* ``hand``: a hand-written PyTorch loop with ``loss / k``, the floor for
  speed: :class:`HandLoop`.
* ``accumgrad``: the same loop with :class:`skorch_gradacc.AccumGrad`
  instead of ``loss / k``: :class:`AccumGradLoop`.

Every skorch contender is built by :func:`make_net` with the same settings
(SGD with momentum, shuffled training data, no validation split, logits and
``CrossEntropyLoss``), so that they differ only in how they accumulate.
"""

import torch
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin

from skorch_gradacc import AccumGrad, GradAccNeuralNetClassifier
from skorch_gradacc.demo import NaiveDivideByK

__all__ = ['AccelerateNet', 'AccumGradLoop', 'FAQRecipeNet', 'HandLoop',
           'make_net']


class FAQRecipeNet(NeuralNetClassifier):
    """skorch's FAQ recipe for gradient accumulation, as written there.

    From "How can I perform gradient accumulation with skorch?" in skorch's
    ``docs/user/FAQ.rst``. The FAQ still shows the old ``train_step(self,
    Xi, yi)`` signature; this is the same code for skorch 1.x's
    ``train_step(self, batch)``, exactly as skorch's own test
    ``test_gradient_accumulation`` in ``skorch/tests/test_net.py`` writes it.
    Nothing else is changed or fixed.
    """

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
    """``NeuralNetClassifier`` trained through Hugging Face Accelerate.

    Pass ``accelerator=Accelerator(gradient_accumulation_steps=k)`` to use
    Accelerate's accumulation, as skorch's documentation of
    ``AccelerateMixin`` suggests.
    """


def make_accelerator(acc_steps):
    """A CPU ``Accelerator`` that accumulates ``acc_steps`` micro-batches.

    Accelerate keeps ``gradient_accumulation_steps`` in a state shared by all
    ``Accelerator`` objects of the process: the last one created sets it for
    all. Create the accelerator right before the net that uses it trains.
    """
    from accelerate import Accelerator

    return Accelerator(gradient_accumulation_steps=acc_steps, cpu=True)


def make_net(kind, module, module_kwargs, batch_size, acc_steps=1, lr=0.05,
             max_epochs=1, **kwargs):
    """Build one skorch contender; see the module docstring for ``kind``.

    ``batch_size`` is the micro-batch size ``B``; ``kind='plain'`` takes the
    batch size as given (pass ``B * k`` for the large-batch net).
    """
    params = dict(
        criterion=torch.nn.CrossEntropyLoss,
        optimizer=torch.optim.SGD,
        optimizer__momentum=0.9,
        lr=lr,
        max_epochs=max_epochs,
        batch_size=batch_size,
        train_split=None,
        iterator_train__shuffle=True,
        verbose=0,
    )
    params.update({'module__' + key: value
                   for key, value in module_kwargs.items()})
    params.update(kwargs)
    if kind == 'plain':
        return NeuralNetClassifier(module, **params)
    if kind == 'gradacc':
        return GradAccNeuralNetClassifier(module, acc_steps=acc_steps, **params)
    if kind == 'faq':
        return FAQRecipeNet(module, acc_steps=acc_steps, **params)
    if kind == 'naive':
        return NaiveDivideByK(module, acc_steps=acc_steps, **params)
    if kind == 'accelerate':
        # AccelerateMixin logs through accelerator.print, which ignores
        # verbose=0; skorch's print keeps the run as quiet as the others.
        params.setdefault('callbacks__print_log__sink', print)
        return AccelerateNet(
            module, accelerator=make_accelerator(acc_steps), device=None,
            unwrap_after_train=False, **params)
    raise ValueError('unknown contender kind {!r}'.format(kind))


class HandLoop:
    """A hand-written PyTorch training loop with ``loss / k`` accumulation.

    The loop everyone writes (and Accelerate's documentation shows): backward
    on ``loss / acc_steps``, step every ``acc_steps`` micro-batches and after
    the last one. It does nothing else: no per-batch logging, no callbacks,
    no history. It is the floor for the time an epoch can take.

    Parameters
    ----------
    module : torch.nn.Module
      The initialized module.

    loader : iterable
      Yields micro-batches ``(X, y)`` of tensors; by default a
      ``DataLoader`` over a ``TensorDataset``. Passing a skorch net's
      iterator instead measures skorch's data path alone.

    acc_steps : int
      Micro-batches per optimizer step.

    """

    def __init__(self, module, loader, acc_steps, lr=0.05):
        self.module = module
        self.loader = loader
        self.acc_steps = acc_steps
        self.criterion = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)

    @classmethod
    def from_arrays(cls, module, X, y, batch_size, acc_steps, lr=0.05):
        dataset = torch.utils.data.TensorDataset(
            torch.as_tensor(X), torch.as_tensor(y))
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=True)
        return cls(module, loader, acc_steps, lr=lr)

    def epoch(self):
        """Train for one epoch."""
        self.module.train()
        n_batches = len(self.loader)
        for i, (Xi, yi) in enumerate(self.loader, start=1):
            loss = self.criterion(self.module(Xi), yi)
            (loss / self.acc_steps).backward()
            if i % self.acc_steps == 0 or i == n_batches:
                self.optimizer.step()
                self.optimizer.zero_grad()


class AccumGradLoop(HandLoop):
    """The hand-written loop with :class:`skorch_gradacc.AccumGrad`.

    The standard loop, ``zero_grad``, ``backward``, ``step``, with no
    ``loss / k``: the wrapper steps once per ``acc_steps`` micro-batches.
    Each micro-batch's rows are counted (``set_count``), so a short last
    micro-batch weighs what it holds, and the epoch's partial last group is
    flushed. Same parameters as :class:`HandLoop`.
    """

    def __init__(self, module, loader, acc_steps, lr=0.05):
        super().__init__(module, loader, acc_steps, lr=lr)
        self.optimizer = AccumGrad(self.optimizer, acc_steps)

    def epoch(self):
        """Train for one epoch."""
        self.module.train()
        for Xi, yi in self.loader:
            self.optimizer.zero_grad()
            self.optimizer.set_count(len(yi))
            self.criterion(self.module(Xi), yi).backward()
            self.optimizer.step()
        self.optimizer.flush()
