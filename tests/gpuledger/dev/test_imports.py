"""The module import graph (gpuledger/dev/imports.py): no cycle, no CLI below the CLI, no dev tooling in producers."""

import subprocess
import sys
import textwrap

from gpuledger.dev.imports import REPO_ROOT, cycles, import_graph, importers


def test_the_import_graph_has_no_cycle():
    result = subprocess.run([sys.executable, "-m", "gpuledger.dev.imports"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert "no cycle" in result.stdout


def test_the_checker_sees_cycles_hidden_in_functions(tmp_path):
    (tmp_path / "gpuledger").mkdir()
    (tmp_path / "gpuledger" / "__init__.py").write_text("")
    (tmp_path / "gpuledger" / "a.py").write_text("from gpuledger.b import thing\n")
    (tmp_path / "gpuledger" / "b.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from gpuledger.c import Never  # not a runtime import
        thing = 1
        def later():
            from gpuledger import a  # hidden in a function: still a cycle
    """))
    (tmp_path / "gpuledger" / "c.py").write_text("import gpuledger.b\n")
    graph = import_graph(tmp_path, ["gpuledger"])
    assert graph["gpuledger.b"] == {"gpuledger.a"} and graph["gpuledger.c"] == {"gpuledger.b"}
    assert cycles(graph) == [["gpuledger.a", "gpuledger.b", "gpuledger.a"]]
    result = subprocess.run([sys.executable, "-m", "gpuledger.dev.imports", "--root", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "gpuledger.a, gpuledger.b" in result.stderr


def test_only_the_cli_imports_the_cli_and_no_producer_imports_dev_tooling():
    graph = import_graph()
    outside = {m for m in importers(graph, "gpuledger.cli") if m != "gpuledger.cli" and not m.startswith("gpuledger.cli.")}
    assert not outside, f"modules outside gpuledger/cli import it: {sorted(outside)}"
    producers = {m: deps for m, deps in importers(graph, "gpuledger.dev").items() if m.split(".")[0] == "producers"}
    assert not producers, f"producers import gpuledger.dev: {producers}"
