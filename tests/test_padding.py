"""A padding pass runs the module on stand-in rows, for modules that refuse zero.

Under torchrun a rank without rows pads (tests/test_distributed.py and
tests/test_fully_sharded.py: modules that refuse zero rows match plain
skorch); here, what a padding pass is, in one process.
"""

import torch

from skorch_gradacc import GradAccNeuralNetClassifier
from skorch_gradacc.batching import padding_batch

from conftest import RowsNeededMLP, classification_data


class CountsRows(RowsNeededMLP):
    """Refuses zero rows; counts the training rows it saw, in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer('rows_seen', torch.zeros((), dtype=torch.long))

    def forward(self, X):
        if self.training:
            self.rows_seen += len(X)
        return super().forward(X)


def test_a_padding_batch_has_no_rows_and_holds_two_of_x():
    X, y = torch.arange(12.).reshape(4, 3), torch.arange(4)
    empty_X, empty_y = padding_batch((X, y))
    assert empty_X.shape == (0, 3) and empty_y.shape == (0,)
    torch.testing.assert_close(empty_X.stand_in_, X[:2], rtol=0, atol=0)
    storage = empty_X.stand_in_.untyped_storage()
    assert storage.data_ptr() != X.untyped_storage().data_ptr()  # a copy
    # a dict X (keywords of forward), and a batch of X alone
    empty = padding_batch(({'a': X, 'b': X[:, 0]}, y))[0]
    assert [value.shape for value in empty.values()] == [(0, 3), (0,)]
    assert [value.shape for value in empty.stand_in_.values()] == [(2, 3), (2,)]
    assert padding_batch(X[:1]).stand_in_.shape == (1, 3)
    # no stand-in for what is neither (a list X): zero rows as they are
    assert getattr(padding_batch(([X, X], y))[0], 'stand_in_', None) is None


def test_a_padding_pass_runs_real_rows_and_changes_nothing():
    # outputs of zero rows, in the graph: the backward gives every parameter
    # a zero gradient (the collectives of DDP and FSDP2 run); the buffers
    # the forward pass changed are as before
    X, y = classification_data(8)
    net = GradAccNeuralNetClassifier(CountsRows, acc_steps=2).initialize()
    net.module_.train()
    out = net.infer(padding_batch((torch.as_tensor(X), torch.as_tensor(y)))[0])
    assert out.shape == (0, 3) and out.requires_grad
    (0 * out.sum()).backward()
    for param in net.module_.parameters():
        assert param.grad is not None and not param.grad.any()
    assert net.module_.rows_seen == 0
    assert net.infer(torch.as_tensor(X[:3])).shape == (3, 3)  # a real pass
    assert net.module_.rows_seen == 3
