"""The CPU decode-attention kernel against attention written out in torch."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from kvwise.engine import cpu_kernel
from kvwise.engine.cpu_kernel import paged_decode_kernel

kernel = paged_decode_kernel()
pytestmark = pytest.mark.skipif(
    kernel is None and not os.environ.get("CI"), reason="no C++ compiler: the engine uses SDPA here"
)


def reference(query, keys, values, tables, lengths, scale, softcap, window):
    """query [B, H, D]; keys, values [blocks, block_size, kv_heads, D]; the same maths, gathered."""
    batch, heads, dim = query.shape
    kv_heads = keys.shape[2]
    outputs = []
    for b in range(batch):
        length = int(lengths[b])
        k = keys[tables[b]].flatten(0, 1)[:length].repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = values[tables[b]].flatten(0, 1)[:length].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b], k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if window:
            scores[:, : max(0, length - window)] = float("-inf")
        outputs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outputs)


def test_builds_where_ci_runs():
    assert kernel is not None, "the CPU decode kernel did not build; see $KVWISE_HOME/kernels/*/FAILED"


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def variant(request):
    """The kernel as built for this CPU, built without AVX-512 (the AVX2 code path), and built
    for baseline x86-64 (the plain C++ loops that CPUs without AVX2, such as ARM, compile)."""
    if request.param == "native":
        return kernel
    if request.param == "portable":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("the portable build's -march=x86-64 is for x86 machines")
        return cpu_kernel.build_kernel([*cpu_kernel.FLAGS, "-march=x86-64", "-mtune=generic"]).paged_decode
    if "avx512f" not in cpu_kernel._cpu_flags().split():
        pytest.skip("this CPU has no AVX-512: the native build is the AVX2 one")
    return cpu_kernel.build_kernel([*cpu_kernel.FLAGS, "-mno-avx512f"]).paged_decode


@pytest.fixture(params=[1, 4], ids=["per-sequence-tasks", "per-kv-head-tasks"])
def threads(request):
    """6 sequences: one thread gives one task per sequence, four threads one per kv head."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "softcap", "window"),
    [(9, 3, 64, 0.0, 0), (4, 4, 16, 0.0, 0), (8, 2, 72, 50.0, 0), (6, 3, 128, 0.0, 7), (2, 1, 80, 30.0, 5)],
)
def test_matches_attention_over_gathered_blocks(variant, threads, heads, kv_heads, dim, softcap, window):
    torch.manual_seed(heads * dim)
    num_blocks, block_size, batch = 40, 4, 6
    shape = (num_blocks, block_size, kv_heads, dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    lengths = torch.tensor([1, 3, 4, 9, 17, 23])
    tables = torch.stack([torch.randperm(num_blocks)[:6] for _ in range(batch)])  # padding entries never read
    query = torch.randn(batch, heads, dim)
    scale = dim**-0.5
    got = variant(query, keys, values, tables, lengths, scale, softcap, window)
    expected = reference(query, keys, values, tables, lengths, scale, softcap, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_nan_scores_stay_nan():
    """A NaN from upstream shows, as SDPA would show it, instead of a quiet average."""
    keys, values = torch.randn(4, 4, 1, 16), torch.randn(4, 4, 1, 16)
    query = torch.randn(1, 2, 16)
    query[0, 1, 0] = float("nan")
    got = kernel(query, keys, values, torch.tensor([[0, 1, 2, 3]]), torch.tensor([16]), 0.25, 0.0, 0)
    assert got[0, 0].isfinite().all() and got[0, 1].isnan().all()


def test_one_sequence_splits_by_kv_head():
    """Fewer sequences than threads: tasks are (sequence, kv head) pairs; same result."""
    torch.manual_seed(0)
    keys, values = torch.randn(8, 16, 4, 32), torch.randn(8, 16, 4, 32)
    query, tables, lengths = torch.randn(1, 8, 32), torch.tensor([[5, 2, 7]]), torch.tensor([40])
    got = kernel(query, keys, values, tables, lengths, 0.2, 0.0, 0)
    torch.testing.assert_close(got, reference(query, keys, values, tables, lengths, 0.2, 0.0, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tables", "lengths", "message"),
    [
        ([[0, 99]], [8], "block id out of range"),
        ([[0, 1]], [9], "length out of range"),
        ([[0, 1]], [0], "length out of range"),
        ([0, 1], [8], "bad shapes"),
    ],
)
def test_bad_tables_are_refused_before_reading(tables, lengths, message):
    keys = torch.zeros(4, 4, 1, 8)
    with pytest.raises(RuntimeError, match=message):
        kernel(torch.zeros(1, 2, 8), keys, keys.clone(), torch.tensor(tables), torch.tensor(lengths), 1.0, 0.0, 0)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (9, 3), (2, 2)])
def test_rows_kernel_matches_attention_over_the_listed_rows(heads, kv_heads, softcap):
    """Each KV head of each sequence reads its own rows (head regions): the same as softmax
    attention over exactly those rows."""
    from kvwise.engine.cpu_kernel import rows_decode_kernel

    kernel = rows_decode_kernel()
    generator = torch.Generator().manual_seed(3)
    batch, dim, pool, width = 5, 64, 700, 90
    query = torch.randn(batch, heads, dim, generator=generator)
    keys, values = torch.randn(pool, dim, generator=generator), torch.randn(pool, dim, generator=generator)
    rows = torch.randint(0, pool, (batch, kv_heads, width), generator=generator)
    lengths = torch.randint(1, width + 1, (batch, kv_heads), generator=generator)
    out = kernel(query, keys, values, rows, lengths, 0.125, softcap)
    group = heads // kv_heads
    for b in range(batch):
        for head in range(heads):
            picked = rows[b, head // group, : lengths[b, head // group]]
            scores = keys[picked] @ query[b, head] * 0.125
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            expected = torch.softmax(scores, dim=-1) @ values[picked]
            torch.testing.assert_close(out[b, head], expected, rtol=1e-5, atol=1e-5)


def test_rows_kernel_refuses_rows_outside_the_pool():
    from kvwise.engine.cpu_kernel import rows_decode_kernel

    kernel = rows_decode_kernel()
    query, keys = torch.randn(1, 2, 16), torch.randn(10, 16)
    rows, lengths = torch.tensor([[[3, 10]]]), torch.tensor([[2]])
    with pytest.raises(RuntimeError, match="row out of range"):
        kernel(query, keys, keys, rows, lengths, 1.0, 0.0)


def test_every_install_compiles_the_same_copies_of_the_sources(tmp_path, monkeypatch):
    """Two installs of the same kernels (a venv, a worktree) share the build directory that their
    contents name; both compile its copies, so neither makes ninja rebuild the other's module."""
    first, second = tmp_path / "one", tmp_path / "two"
    for install in (first, second):
        install.mkdir()
        for source in cpu_kernel.SOURCES:
            (install / source.name).write_bytes(source.read_bytes())
    build = tmp_path / "build"
    build.mkdir()
    monkeypatch.setattr(cpu_kernel, "SOURCES", sorted(first.glob("*.cpp")))
    copies = cpu_kernel._sources_in(build)
    stamps = [copy.stat().st_mtime_ns for copy in copies]
    monkeypatch.setattr(cpu_kernel, "SOURCES", sorted(second.glob("*.cpp")))
    assert cpu_kernel._sources_in(build) == copies  # the same paths whichever install asks
    assert [copy.stat().st_mtime_ns for copy in copies] == stamps  # and untouched: nothing to rebuild
    assert all(copy.parent == build / "sources" for copy in copies)
    (second / copies[0].name).write_text("// changed\n")
    monkeypatch.setattr(cpu_kernel, "SOURCES", sorted(second.glob("*.cpp")))
    cpu_kernel._sources_in(build)
    assert copies[0].read_text() == "// changed\n"  # a changed source is copied (its digest differs anyway)
