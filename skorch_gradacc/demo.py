"""Demo: accumulated training is large-batch training, in less memory.

Run ``python -m skorch_gradacc.demo --help`` for the options. The demo trains
the same MLP on scikit-learn's bundled digits data three ways, from the same
initial weights and in the same sample order:

* plain skorch with ``batch_size * acc_steps`` (the large batch, the truth);
* ``GradAccNeuralNetClassifier`` with ``batch_size`` and ``acc_steps``;
* the naive recipe of most training loops (each loss divided by
  ``acc_steps``, the last partial group stepped anyway; skorch's FAQ recipe
  does not step it);

and prints them side by side with a verdict. Nothing is downloaded.
``--plot PATH`` saves the loss curves beside each run's parameter distance
from the large-batch run, epoch by epoch.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, ProgressBar

from skorch_gradacc import GradAccNeuralNetClassifier
from skorch_gradacc.meters import track_activation_memory

__all__ = ['main', 'max_param_diff']

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
    """Naive accumulation, as in most training loops.

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


class ParamTrace(Callback):
    """Record a copy of the module's parameters at the end of each epoch."""

    def on_train_begin(self, net, **kwargs):
        self.params_ = []

    def on_epoch_end(self, net, **kwargs):
        self.params_.append({key: value.detach().clone() for key, value
                             in net.module_.state_dict().items()})


def positive_int(text):
    """Parse a positive integer for argparse, with a clear message."""
    try:
        value = int(text)
    except ValueError:
        value = 0
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
    parser.add_argument('--repeats', type=positive_int, default=3,
                        help='timed fits of each run; the table reports the '
                             'median time (default: 3)')
    parser.add_argument('--plot', metavar='PATH', default=None,
                        help='save the loss curves and each run\'s parameter '
                             'distance from the large batch to PATH; the '
                             'format follows the extension (PNG if none)')
    args = parser.parse_args(argv)
    if args.plot is not None:
        args.plot = check_plot_path(parser, args.plot)
    return args


def check_plot_path(parser, text):
    """Return the path that ``--plot`` will write; refuse a bad one.

    Parameters
    ----------
    parser : argparse.ArgumentParser
      Its ``error`` method refuses a bad path: a one-line message and exit
      status 2, before any training starts.
    text : str
      The ``--plot`` argument. Without an extension, the figure is a PNG
      and ``.png`` is added to the path, as matplotlib does.

    Returns
    -------
    pathlib.Path
      The file that the figure will be written to.

    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        parser.error('--plot needs matplotlib: python -m pip install '
                     'matplotlib')

    path = Path(text)
    if not path.suffix:
        path = path.with_name(path.name + '.png')
    if Path(text).is_dir() or path.is_dir():
        parser.error('--plot: {} is a directory; give a file name, such as '
                     '{}'.format(text, Path(text) / 'curves.png'))
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        parser.error('--plot: unsupported file type {!r}; use one of {}'.format(
            path.suffix, ', '.join('.' + ext for ext in sorted(formats))))
    parent = path.parent
    if not parent.is_dir():
        parser.error('--plot: directory {} does not exist'.format(parent))
    if not os.access(parent, os.W_OK | os.X_OK):
        parser.error('--plot: directory {} is not writable'.format(parent))
    return path


def load_data():
    X, y = load_digits(return_X_y=True)
    return StandardScaler().fit_transform(X).astype(np.float64), y


def train(label, net, X, y, repeats=1):
    """Fit ``net`` from seed 0 ``repeats`` times; report the median time.

    Every fit starts from the same seed and gives the same net; timing
    several and taking the median keeps a slow outlier (a one-time cost, a
    busy machine) out of the ``seconds`` column.

    Parameters
    ----------
    label : str
      The run's name in the table and the figure.
    net : skorch.NeuralNet
      The net, with a :class:`ParamTrace` callback named ``'trace'``.
    X, y : numpy.ndarray
      The training data.
    repeats : int
      How many fits to time.

    Returns
    -------
    dict
      The fitted net, the time of each fit (``times``) and their median
      (``seconds``), the peak activation memory, the losses, the last
      validation accuracy and the parameters after each epoch.

    """
    sys.stderr.write('{}: {} fit(s)\n'.format(label, repeats))
    times = []
    for _ in range(repeats):
        torch.manual_seed(0)
        start = time.perf_counter()
        with track_activation_memory() as memory:
            net.fit(X, y)
        times.append(time.perf_counter() - start)
    return {
        'label': label,
        'net': net,
        'times': times,
        'seconds': statistics.median(times),
        'peak_kib': memory.peak_bytes / 2 ** 10,
        'train_loss': net.history[:, 'train_loss'],
        'valid_acc': net.history[-1, 'valid_acc'],
        'params': dict(net.callbacks_)['trace'].params_,
    }


def max_param_diff(model, reference):
    """Return the largest absolute difference between two models' states.

    The exactness check of the demo and of the benchmarks.

    Parameters
    ----------
    model, reference : skorch.NeuralNet, torch.nn.Module or dict
      Two nets, modules or state dicts with the same keys; a net's
      ``module_`` is compared. Buffers count as well as parameters.

    Returns
    -------
    float
      ``max |model[key] - reference[key]|`` over all entries and keys.

    Examples
    --------
    >>> import torch
    >>> module = torch.nn.Linear(2, 1)
    >>> max_param_diff(module, module.state_dict())
    0.0

    """
    model, reference = (
        getattr(value, 'module_', value) for value in (model, reference))
    state = getattr(reference, 'state_dict', lambda: reference)()
    return max((value - state[key]).abs().max().item() for key, value
               in getattr(model, 'state_dict', lambda: model)().items())


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
        # the package's bar counts optimizer steps: the accumulated run's
        # bar is as long as the large batch's; the naive run's is not a
        # GradAcc net, so its bar counts micro-batches
        net.set_params(callbacks=[('trace', ParamTrace()),
                                  ('progress', ProgressBar())])
        results.append(train(label, net, X, y, repeats=args.repeats))
    return results


def param_distances(result, reference):
    """Return the max absolute parameter difference per epoch.

    Parameters
    ----------
    result, reference : dict
      Two runs, as :func:`train` returns them.

    Returns
    -------
    list of float
      For each epoch, the largest absolute difference between a parameter
      of ``result`` and the same parameter of ``reference``.

    """
    return [max_param_diff(params, ref)
            for params, ref in zip(result['params'], reference['params'])]


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
    lines += ['',
              'act. KiB: peak memory of the tensors saved for backward '
              '(activations), measured.',
              'seconds: median wall time of {} fit(s) of each run, after '
              'a warm-up fit (--repeats).'.format(args.repeats)]
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


def plot(results):
    """Draw the loss curves beside the parameter distances; return the figure.

    The loss curves of the three runs lie close together; the distance of
    each run's parameters from the large-batch run's, per epoch and on a
    log scale, shows how far each really is. A distance of exactly zero
    cannot be drawn on a log scale and is marked at the bottom of the
    axis instead.

    Parameters
    ----------
    results : list of dict
      The large-batch, accumulated and naive runs, as :func:`train` returns
      them, the large batch first.

    Returns
    -------
    matplotlib.figure.Figure
      The loss curves (left) and the parameter distances (right).

    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_dist) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {'large batch': dict(lw=4, alpha=0.4, color='C0'),
              'accumulated': dict(ls='--', marker='o', color='C1'),
              'naive / k': dict(ls=':', marker='x', color='C2')}
    epochs = np.arange(1, len(results[0]['train_loss']) + 1)
    for result in results:
        ax_loss.plot(epochs, result['train_loss'], label=result['label'],
                     **styles[result['label']])
    ax_loss.set_ylabel('train loss')
    ax_loss.set_title('Loss curves (nearly on top of one another)')

    reference = results[0]
    distances = {result['label']: param_distances(result, reference)
                 for result in results[1:]}
    drawn = [d for values in distances.values() for d in values if d > 0]
    floor = min(drawn) / 10 if drawn else 1e-17
    for label, values in distances.items():
        ax_dist.plot(epochs, [max(d, floor) for d in values], label=label,
                     **styles[label])
    ax_dist.set_yscale('log')
    ax_dist.set_ylabel('max |parameter - large batch|')
    ax_dist.set_title('Distance from the large-batch run')
    if any(d == 0 for values in distances.values() for d in values):
        ax_dist.axhline(floor, color='gray', lw=0.5)
        ax_dist.annotate('0 (identical)', (epochs[0], floor), fontsize=8,
                         va='bottom')
    for ax in (ax_loss, ax_dist):
        ax.set_xlabel('epoch')
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
    fig.suptitle('Largest parameter difference from the large batch after '
                 '{} epochs:\naccumulated {:.1e}, naive / k {:.1e}'.format(
                     len(epochs), distances['accumulated'][-1],
                     distances['naive / k'][-1]))
    fig.tight_layout()
    return fig


def save_plot(results, path):
    """Save :func:`plot`'s figure of ``results`` to ``path``.

    Parameters
    ----------
    results : list of dict
      The three runs, as for :func:`plot`.
    path : str or pathlib.Path
      Where to write the figure; the extension gives the format.

    """
    import matplotlib.pyplot as plt

    fig = plot(results)
    try:
        fig.savefig(path, dpi=100)
    finally:
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
        print('Figure saved to {}'.format(args.plot))
    return 0 if max_param_diff(results[1]['net'], results[0]['net']) <= (
        TOLERANCE) else 1


if __name__ == '__main__':
    sys.exit(main())
