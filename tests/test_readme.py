"""The README's Python example runs as it stands, so a newcomer can copy it."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / 'README.md'


def test_readme_example_runs(capsys):
    blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
    assert blocks
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), 'exec'), namespace)
    assert namespace['search'].best_params_['net__acc_steps'] in (1, 4, 8)
    assert "{'net__acc_steps':" in capsys.readouterr().out
