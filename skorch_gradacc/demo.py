"""Demo: accumulated training is large-batch training, in less memory.

Run ``python -m skorch_gradacc.demo --help`` for the options. The demo trains
the same MLP on scikit-learn's bundled digits data three ways, from the same
initial weights and in the same sample order:

* plain skorch with ``batch_size * acc_steps`` (the large batch, the truth);
* ``GradAccNeuralNetClassifier`` with ``batch_size`` and ``acc_steps``;
* the naive recipe (each loss divided by ``acc_steps``, the last partial
  group stepped anyway), as found in skorch's FAQ and most training loops;

and prints them side by side with a verdict. Nothing is downloaded.
"""

import argparse
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback

from skorch_gradacc import GradAccNeuralNetClassifier
from skorch_gradacc.activation_memory import track_activation_memory

__all__ = ['main']

TOLERANCE = 1e-10


class DigitsMLP(torch.nn.Module):
    """An MLP for the 8x8 digits, in float64 so that differences show."""

    def __init__(self, n_hidden=64):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, n_hidden, dtype=torch.float64),
            torch.nn.Tanh(),
            torch.nn.Linear(n_hidden, 10, dtype=torch.float64),
        )

    def forward(self, X):
        return torch.softmax(self.layers(X), dim=-1)


class NaiveDivideByK(NeuralNetClassifier):
    """Naive accumulation, as in skorch's FAQ and most loops.

    Backward on ``loss / k``, step every ``k`` micro-batches, and step
    whatever is left at the end of the epoch.
    """

    def __init__(self, *args, acc_steps=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc_steps = acc_steps

    def train_step(self, batch, **fit_params):
        step = self.train_step_single(batch, **fit_params)
        # the reported loss is the true one; only the gradient is divided
        (step['loss'] / self.acc_steps).backward()
        self.notify('on_grad_computed', named_parameters=list(
            self.get_all_learnable_params()), batch=batch, training=True)
        self.n_micro_ += 1
        if self.n_micro_ % self.acc_steps == 0 or self.n_micro_ == self.n_total_:
            self._step_optimizer(None)
            self._zero_grad_optimizer()
        return step

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi = batch
        y_pred = self.infer(Xi, **fit_params)
        return {'loss': self.get_loss(y_pred, yi, X=Xi, training=True),
                'y_pred': y_pred}

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        super().on_epoch_begin(net, dataset_train=dataset_train, **kwargs)
        self.n_micro_ = 0
        self.n_total_ = int(np.ceil(len(dataset_train) / self.batch_size))
        self._zero_grad_optimizer()


class Progress(Callback):
    """A one-line progress display on stderr, for the three runs."""

    def __init__(self, label, total):
        self.label = label
        self.total = total

    def on_epoch_end(self, net, **kwargs):
        done = len(net.history)
        bar = '#' * (20 * done // self.total)
        sys.stderr.write('\r{:<12} [{:<20}] epoch {}/{}'.format(
            self.label, bar, done, self.total))
        if done == self.total:
            sys.stderr.write('\n')
        sys.stderr.flush()


def positive_int(text):
    """Parse a positive integer for argparse, with a clear message."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            'expected a positive integer, got {!r}'.format(text)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            'expected a positive integer, got {!r}'.format(text))
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog='python -m skorch_gradacc.demo',
        description=(
            'Train on the bundled digits data with a large batch, with '
            'gradient accumulation, and with naive loss / k accumulation, '
            'and compare them side by side.'))
    parser.add_argument('--batch-size', type=positive_int, default=16,
                        help='micro-batch size (default: 16)')
    parser.add_argument('--acc-steps', type=positive_int, default=8,
                        help='micro-batches per optimizer step (default: 8)')
    parser.add_argument('--epochs', type=positive_int, default=5,
                        help='training epochs (default: 5)')
    parser.add_argument('--plot', metavar='PATH', default=None,
                        help='save the loss curves as a PNG image to PATH')
    return parser.parse_args(argv)


def load_data():
    X, y = load_digits(return_X_y=True)
    return StandardScaler().fit_transform(X).astype(np.float64), y


def train(label, net, X, y):
    """Fit ``net`` from seed 0; measure time and peak activation memory."""
    torch.manual_seed(0)
    start = time.perf_counter()
    with track_activation_memory() as memory:
        net.fit(X, y)
    seconds = time.perf_counter() - start
    return {
        'label': label,
        'net': net,
        'seconds': seconds,
        'peak_kib': memory.peak_bytes / 2 ** 10,
        'train_loss': net.history[:, 'train_loss'],
        'valid_acc': net.history[-1, 'valid_acc'],
    }


def max_param_diff(net, reference):
    state = reference.module_.state_dict()
    return max((value - state[key]).abs().max().item()
               for key, value in net.module_.state_dict().items())


def run(args, X, y):
    common = dict(max_epochs=args.epochs, lr=0.1, verbose=0,
                  optimizer=torch.optim.SGD, optimizer__momentum=0.9,
                  iterator_train__shuffle=True)
    large = args.batch_size * args.acc_steps
    runs = [
        ('large batch', NeuralNetClassifier(
            DigitsMLP, batch_size=large, **common)),
        ('accumulated', GradAccNeuralNetClassifier(
            DigitsMLP, batch_size=args.batch_size, acc_steps=args.acc_steps,
            **common)),
        ('naive / k', NaiveDivideByK(
            DigitsMLP, batch_size=args.batch_size, acc_steps=args.acc_steps,
            **common)),
    ]
    # warm up torch and the data path, so the first timed run pays no
    # one-time costs
    NeuralNetClassifier(DigitsMLP, max_epochs=1, train_split=None,
                        verbose=0).fit(X[:64], y[:64])
    results = []
    for label, net in runs:
        net.set_params(callbacks=[Progress(label, args.epochs)])
        results.append(train(label, net, X, y))
    return results


def format_table(results, args):
    reference = results[0]['net']
    lines = [
        'Digits, {} epochs: batch_size={} x acc_steps={} = effective batch {}'
        .format(args.epochs, args.batch_size, args.acc_steps,
                args.batch_size * args.acc_steps),
        '',
        '{:<12} {:>14} {:>12} {:>12} {:>10} {:>10} {:>8}'.format(
            'run', 'max |dparam|', 'first loss', 'last loss', 'valid acc',
            'act. KiB', 'seconds'),
    ]
    for result in results:
        lines.append(
            '{:<12} {:>14.3e} {:>12.6f} {:>12.6f} {:>10.4f} {:>10.2f} {:>8.2f}'
            .format(result['label'], max_param_diff(result['net'], reference),
                    result['train_loss'][0], result['train_loss'][-1],
                    result['valid_acc'], result['peak_kib'], result['seconds']))
    lines.append('')
    lines.append('act. KiB: peak memory of the tensors saved for backward '
                 '(activations), measured.')
    return '\n'.join(lines)


def verdict(results):
    reference = results[0]['net']
    diff = max_param_diff(results[1]['net'], reference)
    naive = max_param_diff(results[2]['net'], reference)
    if diff <= TOLERANCE:
        return ('VERDICT: accumulated training matches the large batch '
                '(max parameter difference {:.1e} <= {:.0e}); the naive '
                'recipe is off by {:.1e}.'.format(diff, TOLERANCE, naive))
    return ('VERDICT: MISMATCH: accumulated training differs from the large '
            'batch by {:.1e} (> {:.0e}).'.format(diff, TOLERANCE))


def save_plot(results, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {'large batch': dict(lw=4, alpha=0.4),
              'accumulated': dict(ls='--', marker='o'),
              'naive / k': dict(ls=':', marker='x')}
    for result in results:
        epochs = np.arange(1, len(result['train_loss']) + 1)
        ax.plot(epochs, result['train_loss'], label=result['label'],
                **styles[result['label']])
    ax.set_xlabel('epoch')
    ax.set_ylabel('train loss')
    ax.set_title('Accumulated training lies on the large-batch curve')
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    """Run the demo; return 0 when accumulation matches the large batch."""
    args = parse_args(argv)
    X, y = load_data()
    results = run(args, X, y)
    print(format_table(results, args))
    print()
    print(verdict(results))
    if args.plot:
        try:
            save_plot(results, args.plot)
        except OSError as exc:
            print('error: cannot write the plot to {!r}: {}'.format(
                args.plot, exc.strerror), file=sys.stderr)
            return 2
        print('Loss curves saved to {}'.format(args.plot))
    return 0 if max_param_diff(results[1]['net'], results[0]['net']) <= (
        TOLERANCE) else 1


if __name__ == '__main__':
    sys.exit(main())
