"""Smoke test of the benchmark suite (``python -m benchmarks.run``).

Runs the whole suite once at its ``--quick`` sizes and checks that the JSON,
the Markdown and the PNG are written and well-formed, and that the numbers
are right in kind: GradAcc matches the large-batch net, the FAQ recipe and
Accelerate do not. Speed is never asserted: it depends on the machine.
"""

import json
import sys
from pathlib import Path

import pytest

# the suite compares against AccelerateMixin and draws its plots
pytest.importorskip('accelerate')
pytest.importorskip('matplotlib')

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402
from benchmarks.suite import CONTENDERS, RSS_CONTENDERS  # noqa: E402

MODELS = ('mlp', 'cnn', 'transformer')


@pytest.fixture(scope='module')
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp('benchmarks')
    assert run.main(['--quick', '--out', str(folder)]) == 0
    return folder


@pytest.fixture(scope='module')
def results(out):
    return json.loads((out / 'benchmarks.json').read_text())


def assert_summary(summary, n=None):
    assert summary['min'] <= summary['median'] <= summary['max']
    assert len(summary['values']) == summary['n']
    if n is not None:
        assert summary['n'] == n


class TestOutputs:
    def test_files_written(self, out):
        assert sorted(path.name for path in out.iterdir()) == [
            'benchmarks.json', 'benchmarks.md', 'benchmarks.png']
        assert (out / 'benchmarks.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

    def test_json_has_every_section(self, results):
        assert results['quick'] is True
        for section in run.SECTIONS:
            assert results[section], section
            assert results['seconds'][section] >= 0
        meta = results['meta']
        assert meta['command'].startswith('python -m benchmarks.run --quick')
        assert meta['git_commit']
        assert meta['versions']['torch']
        assert meta['torch_threads'] == 1

    def test_markdown_has_every_section(self, out, results):
        text = (out / 'benchmarks.md').read_text()
        for heading in ('## Targets', '## 1. Overhead', '## 2. Memory',
                        '## 3. Exactness', '## 4. Scaling', '## Profile'):
            assert heading in text
        for target in results['targets']:
            assert target['target'] in text
        # every table row has as many cells as its header
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith('|---'):
                width = lines[i - 1].count('|')
                j = i + 1
                while j < len(lines) and lines[j].startswith('|'):
                    assert lines[j].count('|') == width, lines[j]
                    j += 1

    def test_targets(self, results):
        ids = [target['id'] for target in results['targets']]
        assert ids == ['overhead', 'acc_steps_1', 'memory_activation',
                       'memory_rss_fixed', 'exactness', 'scaling_k',
                       'scaling_data']
        for target in results['targets']:
            assert isinstance(target['met'], bool)
            assert target['measured']


class TestOverhead:
    def test_every_contender_timed_every_round(self, results):
        for model in MODELS:
            entry = results['overhead'][model]
            rounds = entry['rounds']
            assert set(entry['cpu_s']) == set(CONTENDERS)
            for name in CONTENDERS:
                assert_summary(entry['cpu_s'][name], rounds)
                assert_summary(entry['wall_s'][name], rounds)
                assert entry['cpu_s'][name]['min'] > 0
            ratios = entry['ratios']['cpu']
            assert ratios['plain_B']['plain_B']['values'] == [1.0] * rounds
            assert ratios['hand']['hand']['values'] == [1.0] * rounds
            gap = entry['gap']
            assert set(gap) == {'data_path', 'skorch_loop', 'callbacks', 'total'}

    def test_gap_parts_add_up(self, results):
        for model in MODELS:
            gap = results['overhead'][model]['gap']
            parts = [gap[part]['seconds']['values']
                     for part in ('data_path', 'skorch_loop', 'callbacks')]
            for i, total in enumerate(gap['total']['seconds']['values']):
                assert sum(part[i] for part in parts) == pytest.approx(total)


class TestExactness:
    @pytest.mark.parametrize('model', MODELS)
    def test_gradacc_is_the_large_batch(self, results, model):
        assert results['exactness'][model]['gradacc']['max_param_diff'] < 1e-10
        assert results['exactness'][model]['accumgrad']['max_param_diff'] < 1e-10
        assert results['exactness'][model]['gradacc'][
            'train_loss_ratio'] == pytest.approx(1.0, abs=1e-10)

    @pytest.mark.parametrize('model', MODELS)
    def test_other_recipes_are_not(self, results, model):
        entry = results['exactness'][model]
        for kind in ('faq', 'accelerate', 'naive', 'hand'):
            assert entry[kind]['max_param_diff'] > 1e-4, kind
        # the FAQ recipe reports the loss divided by k
        k = entry['config']['k']
        assert entry['faq']['train_loss_ratio'] < 1.5 / k

    @pytest.mark.parametrize('model', MODELS)
    def test_k1_controls_are_plain_skorch(self, results, model):
        entry = results['exactness'][model]
        for kind in ('gradacc', 'faq', 'accelerate', 'naive', 'hand',
                     'accumgrad'):
            assert entry[kind]['control_k1_max_param_diff'] == 0.0, kind


class TestMemory:
    def test_activation_memory_is_that_of_the_micro_batch(self, results):
        for model in MODELS:
            entry = results['memory']['activation'][model]
            assert entry['gradacc_vs_plain_B'] == [1.0] * len(entry['ks'])
            large = entry['plain_Bk_vs_plain_B']
            assert large == sorted(large) and large[-1] > 1.5

    def test_rss_measured(self, results):
        # --quick measures with a fixed mmap threshold only
        assert list(results['memory']['rss']) == ['fixed']
        for by_k in results['memory']['rss']['fixed'].values():
            for entry in by_k.values():
                for label in RSS_CONTENDERS:
                    assert_summary(entry[label]['train_kib'], entry['repeats'])
                    assert entry[label]['train_kib']['min'] > 0
                assert entry['group_input_kib'] > 0


class TestScaling:
    def test_shapes(self, results):
        by_k = results['scaling']['by_k']['mlp']
        assert len(by_k['gradacc']['epoch_cpu_s']) == len(by_k['ks'])
        assert len(by_k['gradacc']['step_cpu_s']) == len(by_k['ks'])
        assert 0 <= by_k['gradacc']['step_fit']['r2'] <= 1 + 1e-9
        by_data = results['scaling']['by_data']
        assert len(by_data['gradacc']['epoch_cpu_s']) == len(by_data['ns'])
