"""The ``module:function`` plugin loader: module paths, file paths, and a clear error for each bad spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from headrace.shared.plugins import PluginError, load_plugin


def test_module_function_and_dotted_attribute() -> None:
    assert load_plugin("os.path:join")("a", "b") == "a/b"
    assert load_plugin("shared.schemas:Sample.model_validate") is not None


def test_file_path_function(tmp_path: Path) -> None:
    f = tmp_path / "my_reward.py"
    f.write_text("def reward(ctx, sample):\n    return 2.5\nVALUE = 3\n")
    fn = load_plugin(f"{f}:reward", what="reward")
    assert fn(None, None) == 2.5
    assert load_plugin(f"{f}:reward") is fn  # loaded once


@pytest.mark.parametrize("spec, fragment", [
    ("no_colon", "expected 'module:function'"),
    (":fn", "expected 'module:function'"),
    ("os.path:", "expected 'module:function'"),
    ("headrace_no_such_module:fn", "not found"),
    ("os.path:no_such_fn", "has no attribute"),
    ("os:sep", "is not callable"),
    ("/definitely/missing/file.py:fn", "does not exist"),
])
def test_bad_specs_raise_plugin_error_naming_the_problem(spec: str, fragment: str) -> None:
    with pytest.raises(PluginError) as e:
        load_plugin(spec, what="reward")
    assert fragment in str(e.value) and "reward" in str(e.value)


def test_file_that_fails_to_import(tmp_path: Path) -> None:
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PluginError) as e:
        load_plugin(f"{f}:x", what="generate")
    assert "boom" in str(e.value) and "generate" in str(e.value)
