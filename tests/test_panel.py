"""The fp32 panel kernel (panel.py, csrc/panel.c): the stock product's values with each row the same
whatever the row count, built once per CPU and compiler into the cache, turned off or missing with
fp32 falling back to oneDNN, and the mask-slot adapter's delta in the same pass or in one C call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidar_convert.runtime import kernels, panel
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.session import session_of

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="this torch build has no oneDNN packed linear"
)

needs_panels = pytest.mark.skipif(
    panel.panel_library() is None, reason="no C compiler with OpenMP: no panel kernel"
)


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "out_features,in_features", [(200, 96), (32, 8), (33, 7), (1, 5), (70, 1536)]
)
def test_panel_product_matches_stock_and_each_row_is_the_same_alone_or_among_any_number(
    out_features, in_features, dtype
):
    """Every row count: an AR step's one row, a step's few, a prefill's many (16 at a time): the
    stock product's values, and each row's result bit for bit the same whatever the count. In bf16:
    the product of the weights widened to fp32, rounded once (to one bf16 step: the sums' order
    differs)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features).to(dtype)
    x = torch.randn(75, in_features, dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}

    def reference(rows):
        return F.linear(rows.float(), layer.weight.float(), layer.bias.float()).to(dtype)

    with torch.no_grad(), kernels.packed_linears(layer):
        full = layer(x)
        for rows in (1, 2, 3, 7, 8, 9, 16, 17, 64):
            together = layer(x[:rows])
            assert torch.equal(together, full[:rows]), rows
            torch.testing.assert_close(together, reference(x[:rows]), **tol)
        assert torch.equal(layer(x[70:71]), full[70:71])  # one row alone: as among 75
        torch.testing.assert_close(full, reference(x), **tol)
        assert full.dtype == dtype
        assert layer(x[None, :5]).shape == (1, 5, out_features)  # leading dimensions kept
        # a strided input is made contiguous first
        assert layer(x[::2][:4]).shape == (4, out_features)
        torch.testing.assert_close(layer(x[::2][:4]), reference(x[::2][:4]), **tol)
    assert session_of(layer).kernels.packed[layer]["panels"][1][0] == "panels"


@needs_panels
def test_panels_hold_the_weight_by_32_outputs_zero_padded():
    w = torch.arange(35 * 3, dtype=torch.float32).view(35, 3)
    p = panel.panel_pack(w)
    assert p.shape == (2, 3, 32)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 2], w[34])
    assert not p[1, :, 3:].any()
    with pytest.raises(
        ValueError, match=r"input of 3 features in the panels' dtype \(torch.float32\)"
    ):
        panel.panel_linear(torch.randn(2, 4), p, 35)
    with pytest.raises(
        ValueError, match=r"in the panels' dtype \(torch.float32\).*got torch.bfloat16 x 3"
    ):
        panel.panel_linear(torch.randn(2, 3).bfloat16(), p, 35)
    assert panel.panel_pack(w.bfloat16()).dtype == torch.bfloat16


def test_without_a_compiler_fp32_takes_onednn_and_says_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match=r"could not be built.*Install a C compiler with OpenMP"):
        assert panel.panel_library() is None
    assert panel.panel_library() is None  # decided once: no second warning, no second attempt
    layer = torch.nn.Linear(16, 8)
    with torch.no_grad(), kernels.packed_linears(layer):
        assert layer(torch.randn(3, 16)).shape == (3, 8)
    assert session_of(layer).kernels.packed[layer]["onednn"][1][0] == "onednn"
    assert not list(tmp_path.rglob("*.so"))


def test_an_unwritable_cache_is_named_with_its_fix_not_blamed_on_the_compiler(
    untrained, monkeypatch, tmp_path
):
    """TIDAR_CACHE where no folder can be made (a file, so even root cannot write there), then an
    fp32 generate: the warning names the kernel folder and TIDAR_CACHE, and decoding still runs."""
    import re

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    monkeypatch.setenv("TIDAR_PANEL_KERNEL", "1")
    monkeypatch.setenv("TIDAR_CACHE", str(blocker))
    monkeypatch.setenv("CC", "cc")  # any compiler name: the folder is refused before it runs
    folder = re.escape(str(blocker / "kernels"))
    with pytest.warns(
        UserWarning,
        match=rf"cache folder {folder} is not writable .*Set TIDAR_CACHE to a writable folder",
    ) as seen:
        out = generate(
            torch.tensor([[5, 6, 7]]),
            model=untrained["llama"],
            max_new_tokens=3,
            eos_token_id=None,
            pack_weights=True,
        )
    assert out.shape == (1, 6)
    assert not any("C compiler" in str(w.message) for w in seen)


@needs_panels
def test_the_kernel_is_built_once_per_cpu_and_compiler_then_loaded_from_the_cache(
    monkeypatch, tmp_path
):
    import subprocess

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path))
    monkeypatch.setenv("TIDAR_PANEL_KERNEL", "1")
    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    lib = panel.panel_library()
    built = list((tmp_path / "kernels").iterdir())
    # no temporary folder left behind
    assert lib is not None and len(built) == 1 and built[0].suffix == ".so"

    def no_compiler(*args, **kwargs):
        raise subprocess.SubprocessError("built again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    assert panel.panel_library() is not None
    # another machine sharing the cache: its own build
    monkeypatch.setattr(panel, "_cpu_signature", lambda: "another CPU")
    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    with pytest.warns(UserWarning, match="built again"):
        assert panel.panel_library() is None


def test_the_panel_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    monkeypatch.setenv("TIDAR_PANEL_KERNEL", "0")
    assert panel.panel_library() is None


@needs_panels
@pytest.mark.parametrize(
    "rows,start,in_features,out_features,rank",
    [(10, 6, 576, 1536, 5), (5, 0, 35, 17, 2), (40, 20, 64, 40, 8), (33, 31, 16, 70, 1)],
)
def test_panel_linear_adds_an_adapters_delta_in_the_same_pass(
    rows, start, in_features, out_features, rank
):
    """An adapter's B packed beside W: rows start.. get x @ A.T @ B.T added, the rows before are the
    plain product bit for bit (the extra terms are zeros), with and without a bias."""
    torch.manual_seed(0)
    x, w, bias = (
        torch.randn(1, rows, in_features),
        torch.randn(out_features, in_features),
        torch.randn(out_features),
    )
    A, B = torch.randn(rank, in_features), torch.randn(out_features, rank)
    panels, delta = panel.panel_pack(w), panel.panel_pack(B)
    for b in (None, bias):
        plain = panel.panel_linear(x, panels, out_features, b)
        got = panel.panel_linear(x, panels, out_features, b, (A, delta, start))
        assert torch.equal(got[:, :start], plain[:, :start])
        want = F.linear(x, w, b) + x @ A.T @ B.T
        torch.testing.assert_close(got[:, start:], want[:, start:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="adapter's A"):
        panel.panel_linear(x, panels, out_features, None, (A[:, :-1].contiguous(), delta, start))


@needs_panels
def test_lora_add_takes_many_rows_in_blocks():
    torch.manual_seed(0)
    x, out = torch.randn(1, 80, 32), torch.randn(1, 80, 24)
    # 78 rows x rank 64: more scores than one block holds
    A, B = (torch.randn(64, 32), torch.randn(24, 64))
    got = out.clone()
    assert panel.lora_add(got, x, 2, A, B.T.contiguous())
    torch.testing.assert_close(got[:, 2:], out[:, 2:] + x[:, 2:] @ A.T @ B.T, rtol=1e-4, atol=1e-4)


@needs_panels
@pytest.mark.parametrize(
    "in_features,out_features,rank", [(576, 1536, 3), (35, 17, 2), (16, 16, 1), (64, 40, 8)]
)
def test_lora_add_is_the_low_rank_delta_on_the_rows_from_start(in_features, out_features, rank):
    torch.manual_seed(0)
    x, out = torch.randn(1, 7, in_features), torch.randn(1, 7, out_features)
    A, B = torch.randn(rank, in_features), torch.randn(out_features, rank)
    got = out.clone()
    assert panel.lora_add(got, x, 4, A, B.T.contiguous())
    assert torch.equal(got[:, :4], out[:, :4])
    torch.testing.assert_close(got[:, 4:], out[:, 4:] + x[:, 4:] @ A.T @ B.T, rtol=1e-5, atol=1e-4)
    # bf16 rows with the fp32 adapter (a bf16 model's, adapter.attach): the delta in fp32, each
    # output rounded once, so within one bf16 rounding of torch's fp32 result.
    got16, out16, x16 = out.bfloat16(), out.bfloat16(), x.bfloat16()
    assert panel.lora_add(got16, x16, 4, A, B.T.contiguous())
    assert torch.equal(got16[:, :4], out16[:, :4])
    torch.testing.assert_close(
        got16[:, 4:].float(),
        (out16[:, 4:].float() + x16[:, 4:].float() @ A.T @ B.T).bfloat16().float(),
        rtol=1e-2,
        atol=1e-2,
    )
    # bf16 rows with bf16 deltas (a model cast to bf16 after its adapter was attached): the weights
    # widened exactly, the same fp32 sums, so bit for bit the call with them widened to fp32 first.
    A16, Bt16 = A.bfloat16(), B.T.contiguous().bfloat16()
    got16w, got16f = out16.clone(), out16.clone()
    assert panel.lora_add(got16w, x16, 4, A16, Bt16)
    assert panel.lora_add(got16f, x16, 4, A16.float(), Bt16.float())
    assert torch.equal(got16w, got16f)
    assert torch.equal(got16w[:, :4], out16[:, :4])
    torch.testing.assert_close(
        got16w[:, 4:].float(),
        (out16[:, 4:].float() + x16[:, 4:].float() @ A16.float().T @ Bt16.float())
        .bfloat16()
        .float(),
        rtol=1e-2,
        atol=1e-2,
    )
    # What it does not take, it leaves to the caller: bf16 deltas on fp32 rows, mixed dtypes,
    # batches, strided views.
    assert not panel.lora_add(out.clone(), x, 4, A16, Bt16)
    assert not panel.lora_add(out16.clone(), x16, 4, A16, B.T.contiguous())
    assert not panel.lora_add(out.bfloat16(), x, 4, A, B.T.contiguous())
    assert not panel.lora_add(torch.cat([out, out]), torch.cat([x, x]), 4, A, B.T.contiguous())
    assert not panel.lora_add(
        out.transpose(1, 2).contiguous().transpose(1, 2), x, 4, A, B.T.contiguous()
    )


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 15, 16, 17, 33, 8192, 49153])
def test_argmax_is_torchs_on_every_even_layout_with_ties_and_non_finite_scores(V, dtype):
    """panel.argmax is torch's argmax: the first index of a tie (within one vector lane, across
    lanes, in the tail past the last 16), a NaN as the largest (its first), infinities, signed
    zeros, rows of -inf; on contiguous rows, every other row, a size-1 dim, expanded rows and a
    single row. A layout whose rows are not evenly apart, and other dtypes, are left to torch."""
    from tidar_convert.runtime.verify import argmax

    g = torch.Generator().manual_seed(V)
    for case in range(12):
        x = torch.randint(-2, 3, (6, V), generator=g).float()  # ties everywhere
        if case % 4 == 1:
            x = torch.randn(6, V, generator=g)
        top = x.argmax(-1)
        x[0, (top[0] + V // 2) % V] = x[0, top[0]]  # the maximum again, later
        x[1, [V - 1, max(V - 2, 0)]] = float("nan")  # NaNs in the tail
        x[1, V // 3] = float("nan") if case % 2 else 5.0
        x[2] = float("-inf")
        x[3, [V // 2, V - 1]] = float("inf")
        x[4] = -0.0
        x[4, (case * 7) % V] = 0.0  # +0 and -0 tie: the first zero
        x[5, V - 1] = 1e9 if case % 3 == 0 else x[5, V - 1]  # the largest alone in the tail
        x = x.to(dtype)
        for z in (x, x[::2], x[None], x[1].expand(3, V), x[1], x[:, : max(V - 1, 1)]):
            got = panel.argmax(z)
            assert got is not None and torch.equal(got, z.argmax(-1)), (case, z.shape)
            assert torch.equal(argmax(z), z.argmax(-1))
    for uneven in (
        torch.randn(4, 3, V, dtype=dtype)[:, :2],  # 2 rows of each 3
        x[:, None].expand(6, 3, V),  # each row 3 times
    ):
        assert panel.argmax(uneven) is None
        assert torch.equal(argmax(uneven), uneven.argmax(-1))
    assert panel.argmax(x.to(torch.float16)) is None
    assert panel.argmax(x.t()) is None or V == 1


def test_argmax_never_builds_the_kernel_library(monkeypatch):
    """An argmax on a machine or step that never loaded the library (a GPU, TIDAR_PANEL_KERNEL=0,
    pack_weights=False) stays torch's: it does not compile C on first use."""
    from tidar_convert.runtime.verify import argmax

    monkeypatch.setattr(panel, "_PANEL_LIB", [])
    monkeypatch.setattr(panel, "_build_panel_library", lambda: pytest.fail("built"))
    x = torch.randn(3, 100)
    assert panel.argmax(x) is None and torch.equal(argmax(x), x.argmax(-1))


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [4, 17, 33, 8192, 49153])
def test_top_choices_are_the_k_largest_earlier_first_with_softmaxs_probabilities(V, dtype):
    """panel.top_choices: each row's k largest scores, largest first and the earlier index first
    among equals (ties inside a lane, across lanes, in the tail), with torch's softmax
    probabilities to fp32 rounding; rows not evenly apart give what their contiguous copy gives;
    a NaN, a row of -inf, k past 16 or past the row are left to torch (None)."""
    g = torch.Generator().manual_seed(V)
    for case in range(8):
        x = torch.randint(-3, 3, (5, V), generator=g).float()  # ties everywhere
        if case % 2:
            x = torch.randn(5, V, generator=g) * 4
        x[1, V // 2 :] = float("-inf")
        x[2, V - 1] = 50.0  # the largest alone in the tail
        x = x.to(dtype)
        for k in {1, 2, min(4, V), min(16, V)}:
            idx, chance = panel.top_choices(x, k)
            wide = x.float()
            # the reference: by value, largest first, then by index
            order = torch.sort(-wide, dim=-1, stable=True).indices[:, :k]
            assert torch.equal(idx, order), (case, k)
            expected = wide.softmax(-1).gather(-1, idx)
            torch.testing.assert_close(chance, expected, rtol=1e-4, atol=1e-6)
            uneven = torch.stack([x, x], 1)[:, 0]  # rows 2 * V apart: not a view the kernel reads
            got = panel.top_choices(uneven[::2], k)
            assert torch.equal(got[0], idx[::2]) and torch.equal(got[1], chance[::2])
    x = torch.randn(3, V, dtype=dtype)
    x[1, V // 2] = float("nan")
    assert panel.top_choices(x, 2) is None
    assert panel.top_choices(torch.full((2, V), float("-inf"), dtype=dtype), 1) is None
    assert panel.top_choices(torch.randn(2, V, dtype=dtype), 17) is None
    assert panel.top_choices(torch.randn(2, 3, dtype=dtype), 4) is None
