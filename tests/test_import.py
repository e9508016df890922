from conftest import run_python


def test_import_loads_no_heavy_or_optional_module_and_leaves_environment_alone():
    result = run_python(
        """
        import os, sys
        before = dict(os.environ)
        import tpunb
        heavy = [m for m in ("torch_xla", "torch", "matplotlib", "ipywidgets", "lightning",
                             "pytorch_lightning") if m in sys.modules]
        print(heavy, dict(os.environ) == before)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[] True"
