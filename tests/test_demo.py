"""The README's demo command runs and gives a true verdict."""

import subprocess
import sys

import pytest

from skorch_gradacc import demo


def test_demo_matches_large_batch(capsys, tmp_path):
    plot = tmp_path / 'curves.png'
    status = demo.main(['--epochs', '2', '--acc-steps', '4', '--plot',
                        str(plot)])
    out = capsys.readouterr().out
    assert status == 0
    assert 'VERDICT: accumulated training matches the large batch' in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith(('large', 'accumulated', 'naive'))}
    assert set(rows) == {'large', 'accumulated', 'naive'}
    assert plot.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_verdict_reports_a_mismatch():
    # the verdict is computed, not printed unconditionally
    args = demo.parse_args(['--epochs', '1', '--acc-steps', '4'])
    X, y = demo.load_data()
    results = demo.run(args, X, y)
    results[1] = results[2]  # pretend accumulation was the naive recipe
    assert demo.verdict(results).startswith('VERDICT: MISMATCH')


@pytest.mark.parametrize('option', [
    ['--acc-steps', '0'], ['--batch-size', 'x'], ['--epochs', '-2'],
    ['--unknown']])
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
    for option in ['--acc-steps', '--batch-size', '--epochs', '--plot']:
        assert option in proc.stdout


def test_unwritable_plot_path(capsys, tmp_path):
    status = demo.main(['--epochs', '1', '--plot',
                        str(tmp_path / 'missing' / 'curves.png')])
    assert status == 2
    assert 'cannot write the plot' in capsys.readouterr().err
