"""The package builds, installs from its wheel and imports, as a user gets it.

``python -m build`` makes an sdist and a wheel from a copy of the checkout;
the wheel is installed into a fresh virtual environment and imported from
another directory. The environment is created with
``--system-site-packages`` from the test's interpreter, and sees the
test's own site-packages too (the test may run in a virtual environment),
so that the dependencies are present and nothing is downloaded for the
install itself (``--no-deps --no-index``); ``python -m build`` fetches the build backend
(``setuptools``) as it does for any user.
"""

import re
import shutil
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import skorch_gradacc

ROOT = Path(__file__).resolve().parent.parent
REQUIRES_PYTHON = re.search(r'^requires-python = "(.+)"$',
                            (ROOT / 'pyproject.toml').read_text(), re.M)
IGNORE = shutil.ignore_patterns(
    '.git', '.venv', 'venv', 'build', 'dist', '*.egg-info', '__pycache__',
    '.pytest_cache', '.hypothesis', '_build', 'benchmark_results')


@pytest.fixture(scope='module')
def dist(tmp_path_factory):
    """Build the sdist and the wheel of a copy of the checkout."""
    tmp = tmp_path_factory.mktemp('packaging')
    source = tmp / 'source'
    shutil.copytree(ROOT, source, ignore=IGNORE)
    out = tmp / 'dist'
    proc = subprocess.run(
        [sys.executable, '-m', 'build', '--outdir', str(out), str(source)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_build_makes_an_sdist_and_a_wheel(dist):
    version = skorch_gradacc.__version__
    names = sorted(path.name for path in dist.iterdir())
    assert names == ['skorch_gradacc-{}-py3-none-any.whl'.format(version),
                     'skorch_gradacc-{}.tar.gz'.format(version)]
    with tarfile.open(dist / names[1]) as sdist:
        files = {name.split('/', 1)[1] for name in sdist.getnames()
                 if '/' in name}
    assert {'LICENSE', 'README.md', 'pyproject.toml',
            'skorch_gradacc/__init__.py'} <= files
    with zipfile.ZipFile(dist / names[0]) as wheel:
        files = wheel.namelist()
        metadata = wheel.read('skorch_gradacc-{}.dist-info/METADATA'.format(
            version)).decode()
    packages = {name.split('/')[0] for name in files
                if not name.split('/')[0].endswith('.dist-info')}
    assert packages == {'skorch_gradacc'}  # no tests, docs or benchmarks
    assert any(name.endswith('.dist-info/licenses/LICENSE') for name in files)
    assert 'License-Expression: BSD-3-Clause' in metadata
    assert 'Requires-Python: {}'.format(REQUIRES_PYTHON.group(1)) in metadata


@pytest.mark.slow
def test_wheel_installs_and_imports_in_a_fresh_venv(dist, tmp_path):
    env_dir = tmp_path / 'venv'
    # without pip of its own: this test's pip installs into it (--python)
    venv.EnvBuilder(system_site_packages=True).create(env_dir)
    python = env_dir / 'bin' / 'python'
    # the dependencies: the test's site-packages, as plain path entries, so
    # after the venv's own and without their .pth files (an editable install
    # of the checkout stays out)
    purelib = subprocess.run(
        [str(python), '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
        check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / 'test_site_packages.pth').write_text(
        '\n'.join(site.getsitepackages()) + '\n')
    wheel = next(dist.glob('*.whl'))
    # --ignore-installed: the test's environment may hold the package too
    # (an editable install of the checkout); the wheel goes into the venv
    subprocess.run(
        [sys.executable, '-m', 'pip', '--python', str(python), 'install',
         '--no-deps', '--no-index',
         '--ignore-installed', '--disable-pip-version-check', str(wheel)],
        check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    proc = subprocess.run(
        [str(python), '-c',
         'import skorch_gradacc as p; print(p.__file__); print(p.__version__);'
         'print(p.GradAccNeuralNetClassifier.__name__)'],
        cwd=elsewhere, capture_output=True, text=True, timeout=300,
        env={'PATH': '/usr/bin:/bin'})  # no PYTHONPATH: the checkout is out
    assert proc.returncode == 0, proc.stderr[-3000:]
    file, version, name = proc.stdout.split()
    assert Path(file).is_relative_to(env_dir), file
    assert version == skorch_gradacc.__version__
    assert name == 'GradAccNeuralNetClassifier'


def test_test_extra_names_every_pinned_requirement():
    """``pip install -e .[test]`` gets every package that CI pins."""
    tomllib = pytest.importorskip('tomllib')
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    extras = project['optional-dependencies']

    def name(requirement):
        return re.split(r'[\s<>=!~;\[]', requirement, maxsplit=1)[0].lower()

    pinned = {name(line) for path in (ROOT / 'requirements').glob('*.txt')
              for line in path.read_text().splitlines()
              if line.strip() and not line.startswith(('#', '-r'))}
    offered = {name(req) for req in project['dependencies'] + extras['test']}
    offered |= {name(req) for extra in ('dask', 'demo', 'docs')
                for req in extras[extra]}
    assert 'skorch-gradacc[dask,demo,docs]' in extras['test']
    assert pinned and pinned <= offered, pinned - offered


def test_floor_pins_the_lowest_versions_allowed():
    """requirements/floor.txt pins the lower bound of each of its packages
    in pyproject.toml (numpy 1.23.2: the first 1.23 with wheels for Python
    3.11)."""
    tomllib = pytest.importorskip('tomllib')
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    bounds = dict(re.fullmatch(r'([\w-]+)>=([\d.]+)(?:,.*)?', req).groups()
                  for req in project['dependencies']
                  + project['optional-dependencies']['test']
                  if '>=' in req)
    pins = dict(re.findall(r'^([\w-]+)==(\S+)$', (
        ROOT / 'requirements' / 'floor.txt').read_text(), re.M))
    for package in ['numpy', 'scikit-learn', 'skorch', 'torch']:
        assert package in pins, package
    for package, pin in pins.items():
        bound = bounds[package].split('.')
        assert pin.split('.')[:len(bound)] == bound, (package, pin, bound)


def test_version_follows_pep_440():
    # the canonical public version scheme of PEP 440, without a local part
    pattern = (r'([1-9][0-9]*!)?(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))*'
               r'((a|b|rc)(0|[1-9][0-9]*))?(\.post(0|[1-9][0-9]*))?'
               r'(\.dev(0|[1-9][0-9]*))?')
    assert re.fullmatch(pattern, skorch_gradacc.__version__)
