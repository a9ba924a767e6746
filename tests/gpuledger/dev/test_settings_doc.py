"""docs/operations.md's settings tables are generated from the models (gpuledger/dev/settings_doc.py)."""

import subprocess
import sys

from gpuledger.dev.settings_doc import DOC, render
from gpuledger.settings import env_vars


def test_the_settings_tables_match_the_models():
    result = subprocess.run([sys.executable, "-m", "gpuledger.dev.settings_doc", "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + "\n(run `python -m gpuledger.dev.settings_doc` and commit docs/operations.md)"


def test_every_setting_is_documented_with_its_description():
    text = DOC.read_text()
    for var, (_path, _klass, info) in env_vars().items():
        assert info.description, f"{var} has no Field(description=...)"
        assert f"| `{var}` |" in text
    assert render() in text
