"""The README's demo command runs and gives a true verdict."""

import errno
import subprocess
import sys
import types

import pytest
from skorch.callbacks import ProgressBar
from skorch.toy import make_classifier

from skorch_gradacc import demo

EPOCHS, ACC_STEPS = 2, 4


@pytest.fixture(scope='module')
def results():
    args = demo.parse_args(['--epochs', str(EPOCHS), '--acc-steps',
                            str(ACC_STEPS), '--repeats', '1'])
    X, y = demo.load_data()
    return demo.run(args, X, y)


def test_demo_matches_large_batch(capsys, tmp_path):
    plot = tmp_path / 'curves.png'
    status = demo.main(['--epochs', '2', '--acc-steps', '4', '--repeats', '1',
                        '--plot', str(plot)])
    out = capsys.readouterr().out
    assert status == 0
    assert 'VERDICT: accumulated training matches the large batch' in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith(('large', 'accumulated', 'naive'))}
    assert set(rows) == {'large', 'accumulated', 'naive'}
    assert 'seconds: median wall time of 1 fit(s) of each run' in out
    assert 'Figure saved to {}\n'.format(plot) in out
    assert plot.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_verdict_reports_a_mismatch(results):
    # the verdict is computed, not printed unconditionally
    results = list(results)
    results[1] = results[2]  # pretend accumulation was the naive recipe
    assert demo.verdict(results).startswith('VERDICT: MISMATCH')


@pytest.mark.parametrize('option', [
    ['--acc-steps', '0'], ['--batch-size', 'x'], ['--epochs', '-2'],
    ['--repeats', '0'], ['--unknown']])
def test_bad_options_give_a_message_not_a_traceback(option, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(option)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('usage: python -m skorch_gradacc.demo')
    assert 'error: ' in err


def test_help_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, '-m', 'skorch_gradacc.demo', '--help'],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0
    for option in ['--acc-steps', '--batch-size', '--epochs', '--repeats',
                   '--plot']:
        assert option in proc.stdout


@pytest.mark.parametrize('plot, message', [
    ('{tmp}/missing/curves.png', 'directory {tmp}/missing does not exist'),
    ('curves.xyz', "unsupported file type '.xyz'; use one of"),
    ('{tmp}', '{tmp} is a directory'),
    ('{tmp}/', 'is a directory'),
])
def test_bad_plot_path_is_refused_before_training(plot, message, tmp_path,
                                                  capsys, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError('training started')

    monkeypatch.setattr(demo, 'load_data', no_training)
    monkeypatch.setattr(demo, 'run', no_training)
    with pytest.raises(SystemExit) as exc:
        demo.main(['--plot', plot.format(tmp=tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('usage: python -m skorch_gradacc.demo')
    errors = [line for line in err.splitlines() if 'error:' in line]
    assert errors == [err.splitlines()[-1]]  # a one-line message, last
    assert message.format(tmp=tmp_path) in errors[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_plot_without_matplotlib_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, 'matplotlib.backend_bases', None)
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(['--plot', str(tmp_path / 'curves.png')])
    assert exc.value.code == 2
    assert '--plot needs matplotlib' in capsys.readouterr().err


def test_plot_path_without_extension_is_png(tmp_path):
    args = demo.parse_args(['--plot', str(tmp_path / 'curves')])
    assert args.plot == tmp_path / 'curves.png'  # what matplotlib writes


def test_plot_that_cannot_be_written_after_training(results, capsys,
                                                    monkeypatch, tmp_path):
    def full_disk(results, path):
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(demo, 'run', lambda args, X, y: results)
    monkeypatch.setattr(demo, 'save_plot', full_disk)
    status = demo.main(['--epochs', str(EPOCHS), '--acc-steps',
                        str(ACC_STEPS), '--plot', str(tmp_path / 'x.png')])
    assert status == 2
    assert 'cannot write the plot' in capsys.readouterr().err


def test_plot_shows_the_parameter_distance_per_epoch(results):
    fig = demo.plot(results)
    ax_loss, ax_dist = fig.axes
    assert len(ax_loss.get_lines()) == 3
    # the distances, not the nearly equal losses, separate the runs
    assert ax_dist.get_yscale() == 'log'
    lines = {line.get_label(): line for line in ax_dist.get_lines()}
    accumulated = demo.param_distances(results[1], results[0])
    naive = demo.param_distances(results[2], results[0])
    assert len(accumulated) == len(naive) == EPOCHS
    for label, values in [('accumulated', accumulated), ('naive / k', naive)]:
        drawn = list(lines[label].get_ydata())
        assert len(drawn) == len(values)
        for value, y in zip(values, drawn):
            # a zero distance is drawn below the smallest positive one
            assert y == value if value > 0 else 0 < y < min(
                d for d in accumulated + naive if d > 0)
    assert max(accumulated) <= demo.TOLERANCE < min(naive)
    # the last epoch's distance is the table's max |dparam|
    assert accumulated[-1] == demo.max_param_diff(results[1]['net'],
                                                  results[0]['net'])
    for ax in (ax_loss, ax_dist):
        assert list(ax.get_lines()[0].get_xdata()) == [1, 2]
        ticks = [tick for tick in ax.get_xticks()
                 if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
        assert ticks and all(tick == int(tick) for tick in ticks)
    title = fig._suptitle.get_text()
    assert 'accumulated {:.1e}'.format(accumulated[-1]) in title
    assert 'naive / k {:.1e}'.format(naive[-1]) in title


def test_progress_bar_counts_optimizer_steps(results):
    bars = [dict(result['net'].callbacks_)['progress'] for result in results]
    # skorch's own bar, the object the demo passed: nothing replaced it
    assert all(type(bar) is ProgressBar for bar in bars)
    large, accumulated, naive = (bar.pbar_ for bar in bars)
    # each bar is full at the end of the epoch: the accumulated run's counts
    # its optimizer steps, the naive net's (not a GradAcc net) its
    # micro-batches, each with the run's validation batches
    for bar in (large, accumulated, naive):
        assert bar.n == bar.total
    assert large.total < accumulated.total < naive.total


def test_seconds_is_the_median_of_the_timed_fits(monkeypatch):
    # fits that take 5, 1 and 2 (fake) seconds: the first, cold fit does
    # not set the reported time
    clock = iter([0, 5, 10, 11, 20, 22])
    monkeypatch.setattr(demo, 'time', types.SimpleNamespace(
        perf_counter=lambda: next(clock)))
    X, y = demo.load_data()
    net = demo.NeuralNetClassifier(
        make_classifier(input_units=64, output_units=10), max_epochs=1,
        verbose=0, callbacks=[('trace', demo.ParamTrace())])
    result = demo.train('large batch', net, X[:200].astype('float32'),
                        y[:200], repeats=3)
    assert result['times'] == [5, 1, 2]
    assert result['seconds'] == 2
