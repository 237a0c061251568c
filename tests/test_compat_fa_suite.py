"""scripts/fa_suite.py and the flash_attn shim (torch_flash.testing.fa_shim): FlashAttention's
import paths resolve to torch_flash.compat, and the per-function summary is written."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_FA_TEST = '''
import pytest
import torch
from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM
from flash_attn.layers.rotary import apply_rotary_emb, apply_rotary_emb_torch, RotaryEmbedding
from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn, layer_norm_ref, layer_norm_linear_fn
from flash_attn.losses.cross_entropy import CrossEntropyLoss
import flash_attn.layers.rotary

is_sm90 = torch.cuda.get_device_capability("cuda") == (9, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_forward(causal):
    q = torch.randn(1, 8, 2, 16, device="cuda")
    flash_attn_func(q, q, q, causal=causal)


def test_flash_attn_generator_arg_must_be_none():
    pass
'''


def _run(*args, **env):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_suite_runs_a_test_file_through_the_shim(tmp_path):
    path = tmp_path / "test_fake_fa.py"
    path.write_text(textwrap.dedent(FAKE_FA_TEST))
    summary = tmp_path / "summary.md"
    proc = _run("scripts/fa_suite.py", str(path), "--summary", str(summary))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = summary.read_text()
    assert "test_fake_fa.py::test_flash_attn_generator_arg_must_be_none | 0 | 0 | 1 |" in text
    assert "fa_shim: calls FlashAttention's compiled extension directly" in text
    import torch
    if not torch.cuda.is_available():
        assert "test_fake_fa.py::test_forward | 0 | 0 | 2 |" in text and "needs a CUDA GPU" in text
    else:
        assert "test_fake_fa.py::test_forward | 2 | 0 | 0 |" in text


def test_sample_and_bad_path():
    """--sample keeps a seeded random subset and reports the rest as deselected."""
    import importlib.util
    import types
    spec = importlib.util.spec_from_file_location("fa_suite", os.path.join(ROOT, "scripts", "fa_suite.py"))
    fa_suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fa_suite)
    dropped = []
    config = types.SimpleNamespace(hook=types.SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    picks = []
    for _ in range(2):
        items = list(range(10))
        fa_suite.Selection(3, seed=5).pytest_collection_modifyitems(config, items)
        picks.append(items)
    assert len(picks[0]) == 3 and picks[0] == picks[1] and len(dropped) == 14
    proc = _run("scripts/fa_suite.py", "/nonexistent/test_x.py")
    assert proc.returncode != 0 and "no such file or directory" in proc.stderr


def test_values_keeps_n_values_of_each_parametrize(tmp_path):
    """--values N: every parametrize keeps N of its values (ids with them), so a file whose
    parameters multiply out to thousands of cases collects N**k per function, in one process or
    over pytest-xdist workers."""
    path = tmp_path / "test_grid.py"
    path.write_text(textwrap.dedent('''
        import pytest

        @pytest.mark.parametrize("a", range(10), ids=[f"a{i}" for i in range(10)])
        @pytest.mark.parametrize("b", [1, 2, 3])
        @pytest.mark.parametrize("c", [7])
        def test_grid(a, b, c):
            assert a in range(10) and b in (1, 2, 3) and c == 7
    '''))
    for workers in ([], ["--", "-n", "2"]):  # pytest-xdist's workers select the same cases
        summary = tmp_path / "summary.md"
        proc = _run("scripts/fa_suite.py", str(path), "--values", "2", "--summary", str(summary), *workers)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        row = next(line for line in summary.read_text().splitlines() if "test_grid.py::test_grid |" in line)
        passed, failed, skipped = (int(x) for x in row.split("|")[2:5])
        assert passed + failed + skipped == 4 and failed == 0, workers  # skipped on CPU: no GPU


def test_shim_names_are_compat_and_refuses_a_real_flash_attn():
    code = textwrap.dedent('''
        import sys, types
        import torch_flash.testing.fa_shim as shim
        import flash_attn, flash_attn.layers.rotary as rotary
        from torch_flash import compat
        assert flash_attn.flash_attn_func is compat.flash_attn_func
        assert rotary is compat.layers.rotary and flash_attn.layers.rotary is rotary
        from flash_attn.ops.triton.layer_norm import rms_norm_fn
        assert rms_norm_fn is compat.ops.triton.layer_norm.rms_norm_fn
        shim.install()  # idempotent
        sys.modules["flash_attn"] = types.ModuleType("flash_attn")
        try:
            shim.install()
        except RuntimeError as e:
            assert "the real flash_attn is already imported" in str(e)
        else:
            raise AssertionError("no error")
    ''')
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
