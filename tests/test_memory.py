"""Only one micro-batch's activations are alive at any time."""

import weakref

import torch

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import MLPClassifier


class TrackedMLP(MLPClassifier):
    """Checks at each forward that the previous forward's activation is
    freed, i.e. that no graph of an earlier micro-batch is still held."""

    def __init__(self):
        super().__init__()
        self.previous_ = None
        self.leaks_ = 0
        self.rows_ = []

    def forward(self, X):
        if self.training:
            if self.previous_ is not None and self.previous_() is not None:
                self.leaks_ += 1
            hidden = torch.tanh(self.hidden(X))
            self.previous_ = weakref.ref(hidden)
            self.rows_.append(len(X))
            return torch.softmax(self.output(hidden), dim=-1)
        return super().forward(X)


def test_activations_freed_between_micro_batches(clf_data):
    net = GradAccNeuralNetClassifier(
        TrackedMLP, batch_size=8, acc_steps=4, max_epochs=2, train_split=None,
        verbose=0)
    net.fit(*clf_data)
    module = net.module_
    assert module.leaks_ == 0
    # the module only ever saw micro-batches: 25 of 8 rows and one of 3
    assert max(module.rows_) == 8
    assert module.rows_[:26] == [8] * 25 + [3]


def test_leak_is_detected(clf_data):
    # the check above can fail: a net that keeps the graphs of its
    # micro-batches alive (here with retain_graph=True and holding the losses)
    # is counted as leaking
    held = []

    class HoldingNet(GradAccNeuralNetClassifier):
        def train_step_single(self, batch, **fit_params):
            self._set_training(True)
            Xi, yi = batch
            y_pred = self.infer(Xi, **fit_params)
            loss = self.get_loss(y_pred, yi, X=Xi, training=True)
            loss.backward(retain_graph=True)
            held.append(loss)
            return {'loss': loss, 'y_pred': y_pred}

    net = HoldingNet(TrackedMLP, batch_size=8, acc_steps=4, max_epochs=1,
                     train_split=None, verbose=0)
    net.fit(*clf_data)
    assert net.module_.leaks_ > 0
