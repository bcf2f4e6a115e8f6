"""The decode linear route table (kernels/cuda_linear.route), which needs no GPU: which kernel and
how many launches each column count gets, per weight kind."""

import pytest

from kernels import cuda_linear as cl
from kernels.launch import KernelError

SM = 132


@pytest.fixture(autouse=True)
def no_variant_in_the_environment(monkeypatch):
    """route() reads TANDEM_GEMV_VARIANT, TANDEM_GEMV_STAGED and TANDEM_GEMV_MM; these tests pin them to
    the tensor-core route table ("tc") with the tc16 / tc32 kernels beyond 8 columns (STAGED 0, MM 0);
    the auto rule, the staging kernels and the GEMM have their own tests."""
    monkeypatch.setenv(cl.VARIANT_ENV, "tc")
    monkeypatch.setenv(cl.STAGED_ENV, "0")
    monkeypatch.setenv(cl.MM_ENV, "0")
    monkeypatch.delenv(cl.MM_SPLITS_ENV, raising=False)
    monkeypatch.delenv(cl.MM_SHAPE_ENV, raising=False)
    monkeypatch.delenv(cl.BF16_PIPE_ENV, raising=False)
    monkeypatch.delenv(cl.BLOCKS_ENV, raising=False)


@pytest.mark.parametrize("staged", ["all", "0"])
@pytest.mark.parametrize("kind,tag", [("fp8_row", "fp8row"), ("fp8_block", "fp8blk"), ("nvfp4", "nvfp4")])
def test_quantised_columns_go_to_the_tensor_core_kernels(kind, tag, staged, monkeypatch):
    """9..32 columns per launch of a wide layer (34816 rows, whose I-split fits the staging buffer): the
    x-staging kernels (gemv_*_xs16 / xs32) with TANDEM_GEMV_STAGED=all, the tc16 / tc32 kernels with 0."""
    monkeypatch.setenv(cl.STAGED_ENV, staged)
    wide = "xs" if staged == "all" else "tc"
    for T, suffix in ((2, "tc"), (8, "tc"), (9, wide + "16"), (16, wide + "16"), (17, wide + "32"), (32, wide + "32")):
        r = cl.route(34816, 5120, T, kind, SM)
        assert r["path"] == "gemv" and r["kernel"] == f"gemv_{tag}_{suffix}", (T, r)
        assert r["nt"] >= T
    assert cl.launch_columns(kind, 5120) == 32
    most = 32 if kind == "nvfp4" else 64               # nvfp4: a second 32-column pass costs more than dequantising
    assert cl.gemv_columns(kind, 5120) == most               # (with the GEMM off; it takes nvfp4 to 64)
    for T in (33, 64):                                 # fp8: two launches of the 32-column kernel
        r = cl.route(34816, 5120, T, kind, SM)
        assert r["path"] == "dequant_matmul" if T > most else r["kernel"] == f"gemv_{tag}_{wide}32", (T, r)
    assert cl.route(34816, 5120, most + 1, kind, SM)["path"] == "dequant_matmul"
    monkeypatch.setenv(cl.QCOLUMNS_ENV, "64")          # the benchmark knob
    assert cl.route(34816, 5120, 64, kind, SM)["kernel"] == f"gemv_{tag}_{wide}32"
    monkeypatch.setenv(cl.QCOLUMNS_ENV, "65")
    with pytest.raises(KernelError, match=cl.QCOLUMNS_ENV):
        cl.route(34816, 5120, 64, kind, SM)


@pytest.mark.parametrize("kind", ["fp8_row", "fp8_block", "nvfp4"])
def test_staged_launches_only_where_the_i_split_fits_the_staging_buffer(kind, monkeypatch):
    """An iteration's x (ks steps of 4 chunks, per column) must fit XS_KT elements: the staging kernel
    takes a launch where the block rule's ks does (ks <= 2 for nvfp4, <= 4 for fp8), the tc kernel the
    others, with the same ks and grid either way."""
    epc = 32 if kind == "nvfp4" else 16
    seen = set()
    for O, I in ((1024, 5120), (5120, 17408), (34816, 5120), (64, 2048), (300, 4096), (12288, 5120)):
        for T in (9, 16, 17, 32):
            monkeypatch.setenv(cl.STAGED_ENV, "0")
            tc = cl.route(O, I, T, kind, SM)
            fits = tc["ks"] * 4 * epc <= cl.XS_KT
            seen.add(fits)
            for mode in ("all", "auto"):
                monkeypatch.setenv(cl.STAGED_ENV, mode)
                r = cl.route(O, I, T, kind, SM)
                takes = fits and (mode == "all" or (kind == "nvfp4" and T > 16))
                assert r["kernel"] == (tc["kernel"].replace("_tc", "_xs") if takes else tc["kernel"]), (O, I, T, r)
                assert (r["ks"], r["grid"]) == (tc["ks"], tc["grid"])
    assert seen == {True, False}
    monkeypatch.delenv(cl.STAGED_ENV)
    assert cl.staged_x() == "auto"                    # the default: nvfp4 at 17..32 columns
    monkeypatch.setenv(cl.STAGED_ENV, "1")
    with pytest.raises(KernelError, match="TANDEM_GEMV_STAGED"):
        cl.route(5120, 5120, 16, kind, SM)


def test_small_single_column_layers_keep_the_cuda_core_kernel():
    # 48 rows = 3 tiles: too few blocks for the tensor-core kernel at T = 1
    assert cl.route(48, 5120, 1, "fp8_row", SM)["kernel"] == "gemv_fp8row_t1"
    assert cl.route(48, 5120, 2, "fp8_row", SM)["kernel"] == "gemv_fp8row_tc"


def test_nvfp4_with_odd_half_groups_uses_16_column_launches():
    assert cl.launch_columns("nvfp4", 1040) == 16
    for T in (1, 9, 16, 32):
        assert cl.route(77, 1040, T, "nvfp4", SM)["kernel"] == "gemv_nvfp4h_t16"
    assert cl.route(77, 1040, 40, "nvfp4", SM)["path"] == "dequant_matmul"


def test_bf16_beyond_two_columns_goes_to_cublas():
    assert cl.route(5120, 5120, 2, "bf16", SM)["kernel"] == "gemv_bf16_t2"
    assert cl.route(5120, 5120, 3, "bf16", SM)["path"] == "dequant_matmul"


def test_small_bf16_weight_stays_on_the_gemv_up_to_16_columns():
    """The GDN a|b projections a quantised model keeps in bf16 (96 x 5120 on the 27B, 64 x 2048 on the
    35B-A3B): the GEMV up to MAX_GEMV_COLUMNS, cuBLAS beyond; a weight one row past the limit as before."""
    for O, I in ((96, 5120), (64, 2048), (cl.SMALL_BF16_ELEMS // 5120, 5120)):
        for T in range(1, cl.MAX_GEMV_COLUMNS + 1):
            r = cl.route(O, I, T, "bf16", SM, variant="auto")
            assert r["path"] == "gemv" and r["kernel"] == f"gemv_bf16_t{next(b for b in (1, 2, 4, 8, 16) if b >= T)}"
        assert cl.route(O, I, cl.MAX_GEMV_COLUMNS + 1, "bf16", SM)["path"] == "dequant_matmul"
    big = cl.SMALL_BF16_ELEMS // 5120 + 1
    assert cl.route(big, 5120, 3, "bf16", SM, variant="auto")["kernel"] == "gemv_bf16_pipe"   # BF16_PIPE_ELEMS
    assert cl.route(big, 5120, 3, "bf16", SM, variant="tc")["path"] == "dequant_matmul"
    assert cl._on_gemv("bf16", 5120, 3) is False          # no O given: the column rule alone


def test_bf16_pipe_window_sends_mid_sized_bf16_launches_of_3_to_8_columns_to_the_pipelined_kernel(monkeypatch):
    """TANDEM_GEMV_BF16_PIPE_ELEMS (default BF16_PIPE_ELEMS, 100M): under "auto", bf16 weights of more than
    SMALL_BF16_ELEMS and at most that many elements take gemv_bf16_pipe at 3..8 columns; 1..2 columns
    keep the CUDA-core GEMV, 9+ cuBLAS, larger weights cuBLAS, small ones gemv_bf16_t*, other variants
    their own rules; a value that is not a non-negative integer names the variable."""
    assert cl.bf16_pipe_elems() == cl.BF16_PIPE_ELEMS == 100 << 20
    for O, I in ((12288, 5120), (16384, 5120), (5120, 17408), (2048, 4096)):  # 27B q / in_proj / down; 35B
        assert cl.route(O, I, 8, "bf16", SM, variant="auto")["kernel"] == "gemv_bf16_pipe", (O, I)
    for O, I in ((34816, 5120), (248320, 5120)):                              # 27B gate|up, lm_head
        assert cl.route(O, I, 8, "bf16", SM, variant="auto")["path"] == "dequant_matmul", (O, I)
    monkeypatch.setenv(cl.BF16_PIPE_ENV, "0")
    assert cl.route(2048, 4096, 8, "bf16", SM, variant="auto")["path"] == "dequant_matmul"
    monkeypatch.setenv(cl.BF16_PIPE_ENV, str(1 << 25))
    for O, I in ((2048, 4096), (8192, 2048), (12352, 2048), ((1 << 25) // 4096, 4096)):
        for T in range(1, 12):
            for swiglu in (False, True):
                r = cl.route(O, I, T, "bf16", SM, swiglu=swiglu, variant="auto")
                if T <= 2:
                    assert r["kernel"] == f"gemv_bf16_t{T}", (O, I, T, r)
                elif T <= 8:
                    assert r["kernel"] == "gemv_bf16_pipe" and r["nt"] == 8, (O, I, T, r)
                    assert cl._on_gemv("bf16", I, T, "auto", O)
                else:
                    assert r["path"] == "dequant_matmul", (O, I, T, r)
    for O, I in (((1 << 25) // 4096 + 1, 4096), (248320, 2048)):              # past the window
        assert cl.route(O, I, 8, "bf16", SM, variant="auto")["path"] == "dequant_matmul"
    assert cl.route(96, 5120, 8, "bf16", SM, variant="auto")["kernel"] == "gemv_bf16_t8"   # small: as before
    assert cl.route(2048, 4096, 8, "bf16", SM, variant="tc")["path"] == "dequant_matmul"
    assert cl.route(2048, 4096, 8, "fp8_row", SM, variant="auto")["kernel"] != "gemv_bf16_pipe"
    assert not cl.pipe_applies("bf16", 2052, 8)
    assert cl.route(2048, 2052, 8, "bf16", SM, variant="auto")["path"] == "dequant_matmul"   # I % 8 != 0
    monkeypatch.setenv(cl.BF16_PIPE_ENV, "lots")
    with pytest.raises(KernelError, match=cl.BF16_PIPE_ENV):
        cl.route(2048, 4096, 8, "bf16", SM, variant="auto")


@pytest.mark.parametrize("mm", ["0", "1"])
def test_every_routed_kernel_exists_in_the_source(mm, monkeypatch):
    monkeypatch.setenv(cl.MM_ENV, mm)
    src = (cl.L.CUDA_DIR / "gemv.cu").read_text()
    for variant in cl.VARIANTS:
        for kind in ("bf16", "fp8_row", "fp8_block", "nvfp4"):
            for I in (5120, 1040, 1056):
                for T in range(1, max(cl.GEMV_COLUMNS[kind], cl.MAX_GEMV_COLUMNS) + 1):
                    for O in (48, 5120):
                        for swiglu in (False, True):
                            r = cl.route(O, I, T, kind, SM, swiglu=swiglu, variant=variant)
                            if r["path"] == "dequant_matmul":      # bf16 past its columns: cuBLAS
                                continue
                            assert f" {r['kernel']}(" in src or f"({r['kernel']}," in src, r["kernel"]


@pytest.mark.parametrize("kind,tag", [("fp8_row", "fp8row"), ("fp8_block", "fp8blk"), ("nvfp4", "nvfp4")])
def test_pipelined_variant_takes_quantised_launches_of_up_to_8_columns(kind, tag):
    for O, I in ((5120, 5120), (48, 5120), (1, 64), (34816, 5120), (248320, 5120)):
        for T in range(1, 9):
            for swiglu in (False, True):
                r = cl.route(O, I, T, kind, SM, swiglu=swiglu, variant="pipelined")
                assert r["kernel"] == f"gemv_{tag}_pipe" and r["nt"] == 8 and r["block"] == (256,), (O, I, T, r)
                tiles = -(-(O // 2) // 8) if swiglu else -(-O // 16)
                assert r["units"] == tiles and r["grid"][0] * (8 // r["ks"]) >= tiles
                assert r["ks"] in (1, 2, 4, 8) and r["ks"] <= max(1, -(-(I // (32 if kind == "nvfp4" else 16)) // 4))
        # beyond 8 columns the tensor-core kernels as before, in the same launches
        for T, suffix in ((9, "16"), (16, "16"), (17, "32"), (32, "32")) + (((40, "32"),) if kind != "nvfp4" else ()):
            assert cl.route(O, I, T, kind, SM, variant="pipelined")["kernel"] == f"gemv_{tag}_tc{suffix}"
        assert cl.route(O, I, 65, kind, SM, variant="pipelined")["path"] == "dequant_matmul"
    # the tensor-core route is unchanged
    assert cl.route(5120, 5120, 1, kind, SM)["kernel"] == f"gemv_{tag}_tc"
    assert cl.route(48, 5120, 1, kind, SM)["kernel"] == f"gemv_{tag}_t1"


def test_pipelined_variant_takes_bf16_launches_of_up_to_8_columns():
    """gemv_bf16_pipe: every bf16 launch of <= 8 columns (also the 3-8 the route table gives cuBLAS),
    none beyond; the default route keeps bf16 on the CUDA-core kernels and cuBLAS."""
    for O, I in ((5120, 5120), (1024, 5120), (48, 5120), (3, 8), (248320, 5120)):
        for T in range(1, 9):
            for swiglu in (False, True):
                r = cl.route(O, I, T, "bf16", SM, swiglu=swiglu, variant="pipelined")
                assert r["kernel"] == "gemv_bf16_pipe" and r["nt"] == 8, (O, I, T, r)
                tiles = -(-(O // 2) // 8) if swiglu else -(-O // 16)
                assert r["units"] == tiles and r["grid"][0] * (8 // r["ks"]) >= tiles
                assert r["ks"] <= max(1, -(-(I // 8) // 4))
        beyond = cl.route(O, I, 9, "bf16", SM, variant="pipelined")
        assert beyond["path"] == ("gemv" if O * I <= cl.SMALL_BF16_ELEMS else "dequant_matmul"), (O, I, beyond)
    for T in (1, 2):
        assert cl.route(5120, 5120, T, "bf16", SM)["kernel"] == f"gemv_bf16_t{T}"
    assert cl.route(5120, 5120, 3, "bf16", SM)["path"] == "dequant_matmul"
    assert cl.pipe_applies("bf16", 5120, 8) and not cl.pipe_applies("bf16", 5120, 9)
    assert not cl.pipe_applies("bf16", 5124, 1)


def test_pipelined_variant_leaves_what_it_does_not_serve():
    # nvfp4 rows that are not 4-byte aligned in the scales (I % 64 == 32), nvfp4 half groups
    assert cl.route(5120, 1056, 1, "nvfp4", SM, variant="pipelined")["kernel"] == "gemv_nvfp4_tc"
    assert cl.route(77, 1040, 3, "nvfp4", SM, variant="pipelined")["kernel"] == "gemv_nvfp4h_t16"
    assert cl.route(77, 1040, 3, "fp8_row", SM, variant="pipelined")["kernel"] == "gemv_fp8row_pipe"
    assert not cl.pipe_applies("nvfp4", 1056, 1) and cl.pipe_applies("nvfp4", 1088, 8)
    assert not cl.pipe_applies("fp8_row", 5120, 9)


def test_pipelined_ks_fills_two_blocks_per_sm():
    # q_proj 12288 x 5120: 768 tiles; ks 4 -> 384 blocks >= 2 x 132; gate|up 34816: ks 1 -> 272 blocks
    assert cl.route(12288, 5120, 1, "nvfp4", SM, variant="pipelined")["ks"] == 4
    assert cl.route(34816, 5120, 1, "nvfp4", SM, variant="pipelined")["ks"] == 1
    # down 5120 x 17408: 320 tiles, never 264 blocks before ks 8
    assert cl.route(5120, 17408, 1, "fp8_row", SM, variant="pipelined")["ks"] == 8
    # a single step per row: one warp per tile
    assert cl.route(300, 64, 1, "nvfp4", SM, variant="pipelined")["ks"] == 1


def test_variant_from_the_environment(monkeypatch):
    monkeypatch.setenv(cl.VARIANT_ENV, "pipelined")
    assert cl.gemv_variant() == "pipelined"
    assert cl.route(5120, 5120, 4, "nvfp4", SM)["kernel"] == "gemv_nvfp4_pipe"
    assert cl.route(5120, 5120, 4, "nvfp4", SM, variant="tc")["kernel"] == "gemv_nvfp4_tc"
    monkeypatch.setenv(cl.VARIANT_ENV, "")
    assert cl.gemv_variant() == "auto"
    monkeypatch.setenv(cl.VARIANT_ENV, "fast")
    with pytest.raises(KernelError, match="TANDEM_GEMV_VARIANT"):
        cl.route(5120, 5120, 4, "nvfp4", SM)
    with pytest.raises(KernelError, match="unknown GEMV variant"):
        cl.route(5120, 5120, 4, "nvfp4", SM, variant="fast")


def test_auto_takes_the_pipelined_kernel_where_it_was_measured_faster():
    """auto = pipelined for T <= 8 on the layers the tensor-core kernel splits over >= 4 warps (27B q,
    o, GDN qkv/z, down), the tensor-core kernel on gate|up (split over 2), k/v (O = 1024) and beyond
    8 columns (the pipelined kernels' limit)."""
    def kernel(O, I, T, kind, swiglu=False):
        return cl.route(O, I, T, kind, SM, swiglu=swiglu, variant="auto")["kernel"]
    for kind, tag in (("fp8_row", "fp8row"), ("fp8_block", "fp8blk"), ("nvfp4", "nvfp4")):
        for O, I in ((12288, 5120), (5120, 6144), (10240, 5120), (6144, 5120), (5120, 17408)):
            for T in (1, 2, 4, 5, 8):
                assert kernel(O, I, T, kind) == f"gemv_{tag}_pipe", (O, I, T, kind)
            for T in (9, 16):
                assert kernel(O, I, T, kind).startswith(f"gemv_{tag}_tc"), (O, I, T, kind)
        assert kernel(34816, 5120, 1, kind, swiglu=True) == f"gemv_{tag}_tc"
        assert not kernel(1024, 5120, 1, kind).endswith("_pipe")
        assert not kernel(1024, 5120, 4, kind).endswith("_pipe")
        assert not kernel(34816, 5120, 8, kind, swiglu=True).endswith("_pipe")
    assert kernel(5120, 5120, 1, "bf16") == cl.route(5120, 5120, 1, "bf16", SM, variant="tc")["kernel"]
    # nvfp4 rows must be 64-element multiples for the pipelined kernel: others keep the old kernels
    assert not kernel(5120, 5120 + 32, 1, "nvfp4").endswith("_pipe")


def test_pipe4_stops_the_auto_rule_at_4_columns():
    """pipe4 (auto until the twelfth session): the same layers as auto up to 4 columns, the
    tensor-core kernel at 5..8 columns where auto takes the pipelined one."""
    shapes = [(12288, 5120, False), (5120, 6144, False), (10240, 5120, False), (6144, 5120, False),
              (5120, 17408, False), (34816, 5120, True), (1024, 5120, False), (5120, 5120 + 32, False)]
    for kind in ("fp8_row", "fp8_block", "nvfp4"):
        for O, I, swiglu in shapes:
            for T in (1, 2, 4):
                assert cl.route(O, I, T, kind, SM, swiglu=swiglu, variant="pipe4") == \
                    cl.route(O, I, T, kind, SM, swiglu=swiglu, variant="auto")
            for T in (5, 8):
                r = cl.route(O, I, T, kind, SM, swiglu=swiglu, variant="pipe4")
                assert r == cl.route(O, I, T, kind, SM, swiglu=swiglu, variant="tc"), (O, I, T, kind)
                assert r["T"] == T


def test_ks_rules_from_the_environment(monkeypatch):
    """TANDEM_GEMV_KS (benchmarks): "blocks" (default) is the block-count rule; "tc8" widens only the
    single-column tensor-core launches (27B gate|up: ks 2 -> 8), "wide" also the nvfp4 pipelined
    ones; the kernel auto picks is the same under every rule."""
    def r(O, I, T, kind, swiglu=False, variant="auto"):
        return cl.route(O, I, T, kind, SM, swiglu=swiglu, variant=variant)
    monkeypatch.delenv(cl.KS_ENV, raising=False)
    base = {(O, T, k): r(O, 5120, T, k, O == 34816) for O in (34816, 12288) for T in (1, 8)
            for k in ("nvfp4", "fp8_row")}
    assert base[(34816, 1, "nvfp4")]["ks"] == 2 and base[(34816, 1, "nvfp4")]["kernel"] == "gemv_nvfp4_tc"
    for rule in ("tc8", "wide"):
        monkeypatch.setenv(cl.KS_ENV, rule)
        for (O, T, k), b in base.items():
            got = r(O, 5120, T, k, O == 34816)
            assert got["kernel"] == b["kernel"], (rule, O, T, k)
            widened = T == 1 and (got["kernel"].endswith("_tc") or (rule == "wide" and k == "nvfp4"))
            assert got["ks"] == (8 if widened else b["ks"]), (rule, O, T, k, got)
            assert got["grid"][0] == -(-got["units"] // (8 // got["ks"]))
    monkeypatch.setenv(cl.KS_ENV, "widest")
    with pytest.raises(KernelError, match="TANDEM_GEMV_KS"):
        r(5120, 5120, 1, "nvfp4")


def test_pipelined_blocks_per_sm_from_the_environment(monkeypatch):
    monkeypatch.setenv(cl.PIPE_BLOCKS_ENV, "4")      # q_proj 768 tiles: ks 8 -> 768 blocks >= 4 x 132
    assert cl.route(12288, 5120, 1, "nvfp4", SM, variant="pipelined")["ks"] == 8
    monkeypatch.setenv(cl.PIPE_BLOCKS_ENV, "1")      # ks 2 -> 192 blocks >= 132
    assert cl.route(12288, 5120, 1, "nvfp4", SM, variant="pipelined")["ks"] == 2
    monkeypatch.setenv(cl.PIPE_BLOCKS_ENV, "many")
    with pytest.raises(KernelError, match="TANDEM_GEMV_PIPE_BLOCKS"):
        cl.route(12288, 5120, 1, "nvfp4", SM, variant="pipelined")


# ------------------------------------------------------------------------------------------------
# The dequantising GEMM (gemm_*_n16 / n32 / n64) for quantised launches of 9..64 columns


@pytest.mark.parametrize("kind,tag", [("fp8_row", "fp8row"), ("fp8_block", "fp8blk"), ("nvfp4", "nvfp4")])
def test_gemm_takes_quantised_launches_of_9_to_64_columns(kind, tag, monkeypatch):
    monkeypatch.setenv(cl.MM_ENV, "1")
    for variant in cl.VARIANTS:
        for O, I in ((34816, 5120), (5120, 17408), (48, 5120), (1, 64), (77, 1056 if kind != "nvfp4" else 1088)):
            for swiglu in (False, True):
                for T in (1, 8):                              # up to 8 columns: the GEMV kernels as before
                    assert not cl.route(O, I, T, kind, SM, swiglu=swiglu, variant=variant)["kernel"].startswith("gemm")
                for T, n in ((9, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64)):
                    r = cl.route(O, I, T, kind, SM, swiglu=swiglu, variant=variant)
                    if not cl.mm_wins(T, kind):            # the GEMV kernels where they were faster
                        assert r["kernel"].startswith("gemv_"), (O, I, T, r)
                        continue
                    if kind == "nvfp4":                       # nvfp4 launches take up to 32 columns
                        n = min(n, 32)
                    base = f"gemm_{tag}_n{n}"
                    assert r["kernel"].startswith(base) and r["nt"] == n and r["T"] == min(T, n), (O, I, T, r)
                    # the base shape on the widest layers, the one-row-tile (nvfp4) / 4-step (fp8) ones elsewhere
                    rows = O
                    want = base if rows >= cl.MM_WIDE_ROWS or n == 64 else base + ("_m1" if kind == "nvfp4" else "_p4")
                    assert r["kernel"] == want, (O, T, r["kernel"])
                    mt = cl._MM_KERNELS[r["kernel"]][2]
                    tiles = -(-(O // 2) // 8) if swiglu else -(-O // 16)
                    assert r["units"] == tiles and r["grid"][0] == -(-tiles // (8 * mt)), r
                    S = r["grid"][1]
                    assert S == r["ks"] and 1 <= S <= 16
                    assert S * r["grid"][0] * mt * n * 128 * 8 // 8 <= cl.MM_WS_FLOATS
        assert cl.launch_columns(kind, 5120) == (32 if kind == "nvfp4" else 64)
    # nvfp4 rows of an odd number of 16-element groups keep the CUDA-core kernels, and beyond 32 columns
    # the dequantised path (as before the GEMM)
    assert not cl.route(300, 5120 + 16, 20, "nvfp4", SM)["kernel"].startswith("gemm")
    assert cl.route(300, 5120 + 16, 33, "nvfp4", SM)["path"] == "dequant_matmul"
    assert cl.route(300, 5120, 33, "nvfp4", SM)["kernel"].startswith("gemm")


def test_gemm_splits_i_where_the_row_blocks_leave_sms_idle(monkeypatch):
    """A narrow, deep layer (27B down: 5120 x 17408) gets several slices of I, a wide one (gate|up) few;
    a short row (I = 64) one; the count fills the SMs' resident slots without exceeding the workspace."""
    monkeypatch.setenv(cl.MM_ENV, "1")
    down = cl.route(5120, 17408, 32, "nvfp4", SM)
    wide = cl.route(34816, 5120, 32, "nvfp4", SM, swiglu=True)
    assert down["grid"][1] >= 3 and down["grid"][0] * down["grid"][1] >= 0.9 * SM
    assert wide["grid"][1] <= down["grid"][1]
    assert cl.route(77, 64, 32, "nvfp4", SM)["grid"][1] == 1
    # the model's choice: waves of resident blocks over slices, 2% of a pass per extra slice
    assert cl._mm_splits(20, 1000, 264, 1024) > 1
    assert cl._mm_splits(264, 1000, 264, 1024) == 1          # one full wave already
    assert cl._mm_splits(20, 3, 264, 1024) == 1               # too few iterations to split
    assert cl._mm_splits(cl.MM_COUNTERS + 1, 1000, 264, 8) == 1
    assert cl._mm_splits(20, 1000, 264, cl.MM_WS_FLOATS // 40) <= 2
    # the benchmark override, capped the same way
    monkeypatch.setenv(cl.MM_SPLITS_ENV, "3")
    assert cl.route(5120, 17408, 32, "nvfp4", SM)["grid"][1] == 3
    assert cl.route(77, 64, 32, "nvfp4", SM)["grid"][1] == 1
    monkeypatch.setenv(cl.MM_SPLITS_ENV, "99")
    with pytest.raises(KernelError, match=cl.MM_SPLITS_ENV):
        cl.route(5120, 17408, 32, "nvfp4", SM)


def test_gemm_switch_from_the_environment(monkeypatch):
    monkeypatch.setenv(cl.MM_ENV, "0")
    assert cl.route(34816, 5120, 32, "nvfp4", SM)["kernel"] == "gemv_nvfp4_tc32"
    assert cl.launch_columns("fp8_row", 5120) == 32
    assert cl.gemv_columns("nvfp4", 5120) == 32                      # as before the GEMM: beyond, dequantise + cuBLAS
    monkeypatch.setenv(cl.MM_ENV, "1")
    assert cl.route(34816, 5120, 32, "nvfp4", SM)["kernel"] == "gemm_nvfp4_n32"
    assert cl.gemv_columns("nvfp4", 5120) == 64
    monkeypatch.delenv(cl.MM_ENV)
    assert cl.mm_on()
    monkeypatch.setenv(cl.MM_ENV, "all")                      # benchmarks: also where the GEMV kernels won
    assert cl.route(5120, 17408, 9, "fp8_row", SM)["kernel"] == "gemm_fp8row_n16_p4"
    monkeypatch.setenv(cl.MM_ENV, "yes")
    with pytest.raises(KernelError, match=cl.MM_ENV):
        cl.route(34816, 5120, 32, "nvfp4", SM)


def test_gemm_where_it_was_measured_faster(monkeypatch):
    """nvfp4: every launch of 9..32 columns (33..64 in two); fp8: from 17 columns (up to 64 in one); fp8 at
    9..16 keeps the GEMV kernels."""
    monkeypatch.setenv(cl.MM_ENV, "1")
    for kind in ("fp8_row", "fp8_block", "nvfp4"):
        for O, I, swiglu in ((5120, 17408, False), (34816, 5120, True), (12288, 5120, False)):
            for T in (9, 16, 17, 32, 33, 64):
                k = cl.route(O, I, T, kind, SM, swiglu=swiglu)["kernel"]
                assert k.startswith("gemm_" if (T > 16 or kind == "nvfp4") else "gemv_"), (kind, O, T, k)


def test_gemm_shapes_from_the_environment(monkeypatch):
    monkeypatch.setenv(cl.MM_ENV, "all")                      # every launch the GEMM serves
    monkeypatch.setenv(cl.MM_SHAPE_ENV, "m1")
    r = cl.route(34816, 5120, 16, "nvfp4", SM)
    assert r["kernel"] == "gemm_nvfp4_n16_m1" and r["rows_per_warp"] == 16 and r["grid"][0] == 34816 // 128
    assert cl.route(34816, 5120, 40, "fp8_row", SM)["kernel"] == "gemm_fp8row_n64"   # no _m1 shape: the base one
    monkeypatch.setenv(cl.MM_SHAPE_ENV, "p4")
    assert cl.route(34816, 5120, 16, "fp8_row", SM)["kernel"] == "gemm_fp8row_n16_p4"
    monkeypatch.setenv(cl.MM_SHAPE_ENV, "base")
    r = cl.route(5120, 17408, 16, "nvfp4", SM)
    assert r["kernel"] == "gemm_nvfp4_n16" and r["rows_per_warp"] == 32
    monkeypatch.setenv(cl.MM_SHAPE_ENV, "r")                   # the weight ring: dynamic shared memory
    r = cl.route(5120, 17408, 32, "nvfp4", SM)
    assert r["kernel"] == "gemm_nvfp4_n32_r" and r["smem"] == 3 * 2 * 2 * 256 * 20
    assert cl.route(5120, 5120 + 32, 32, "nvfp4", SM)["kernel"] == "gemm_nvfp4_n32_m1"   # I % 64: no ring
    assert cl.route(5120, 17408, 64, "fp8_row", SM)["smem"] == 4 * 2 * 256 * 16
    assert cl.route(5120, 17408, 64, "fp8_block", SM)["kernel"] == "gemm_fp8blk_n64"
    monkeypatch.setenv(cl.MM_SHAPE_ENV, "wide")
    with pytest.raises(KernelError, match=cl.MM_SHAPE_ENV):
        cl.route(34816, 5120, 16, "nvfp4", SM)


H200_SMEM, BOARD_SMEM = 233472, 102400          # shared memory per SM: sm_90, and sm_86 / 89 / 120


def test_gemm_takes_the_weight_ring_where_it_keeps_its_blocks_per_sm(monkeypatch):
    """Default shape: the _r kernel wherever one exists, I suits it (nvfp4: I % 64 == 0) and two blocks'
    static + ring shared memory fit the SM; the register shapes on 100 KiB boards, without a device
    (smem 0) and under TANDEM_GEMM_SHAPE=reg."""
    monkeypatch.delenv(cl.MM_SHAPE_ENV, raising=False)
    monkeypatch.setenv(cl.MM_ENV, "1")
    for kind in ("fp8_row", "fp8_block", "nvfp4"):
        for O, I, swiglu in ((5120, 17408, False), (34816, 5120, True), (12288, 5120, False)):
            for T in (9, 16, 17, 32, 33, 64):
                reg = cl.route(O, I, T, kind, SM, swiglu=swiglu, smem_sm=0)
                if not reg["kernel"].startswith("gemm_"):
                    continue
                base = "_".join(reg["kernel"].split("_")[:3])
                ring = f"{base}_r" if f"{base}_r" in cl._MM_KERNELS and not (kind == "nvfp4" and I % 64) else None
                got = cl.route(O, I, T, kind, SM, swiglu=swiglu, smem_sm=H200_SMEM)
                assert got["kernel"] == (ring or reg["kernel"]), (kind, O, I, T)
                assert got["smem"] == (cl.mm_ring_bytes(ring) if ring else 0)
                per_sm = cl._MM_KERNELS[got["kernel"]][4]
                assert per_sm * (cl.mm_static_bytes(got["kernel"]) + got["smem"] + 1024) <= H200_SMEM
                assert cl.route(O, I, T, kind, SM, swiglu=swiglu, smem_sm=BOARD_SMEM) == reg
                monkeypatch.setenv(cl.MM_SHAPE_ENV, "reg")
                assert cl.route(O, I, T, kind, SM, swiglu=swiglu, smem_sm=H200_SMEM) == reg
                monkeypatch.delenv(cl.MM_SHAPE_ENV)
    assert cl.route(5120, 17408, 64, "fp8_block", SM, smem_sm=H200_SMEM)["kernel"] == "gemm_fp8blk_n64"  # no ring
    assert cl.route(5120, 5120 + 32, 32, "nvfp4", SM, smem_sm=H200_SMEM)["kernel"] == "gemm_nvfp4_n32_m1"
    assert not cl.mm_ring_fits("gemm_nvfp4_n32_r", BOARD_SMEM) and cl.mm_ring_fits("gemm_nvfp4_n32_r", H200_SMEM)


def test_gemm_table_matches_the_kernel_source():
    """_MM_KERNELS (the host's tile shapes, ring stages and blocks per SM) states what gemv.cu's
    GEMM_Q_KERNEL / GEMM_Q_RING_KERNEL lines compile, one entry per kernel."""
    import re
    src = (cl.L.CUDA_DIR / "gemv.cu").read_text()
    kind_of = {"KIND_FP8ROW": "fp8_row", "KIND_FP8BLK": "fp8_block", "KIND_NVFP4": "nvfp4"}
    found = {}
    for m in re.finditer(r"^GEMM_Q_(RING_)?KERNEL\((\w+), (KIND_\w+), (\d+), (\d+), (\d+), (\d+)(?:, (\d+))?\)", src, re.M):
        ring, name, kind, nb, mt, p, per_sm, d = m.groups()
        found[name] = (kind_of[kind], int(nb), int(mt), int(p), int(per_sm), int(d) if ring else 0)
    assert found == cl._MM_KERNELS


def test_gemv_blocks_per_sm_sets_the_cuda_core_kernels_i_split(monkeypatch):
    """TANDEM_GEMV_BLOCKS (default BLOCKS_PER_SM: bf16 1, the quantised kinds 4): the smallest ks of 1, 2,
    4, 8 that gives that many blocks per SM on gemv_*_t*; a value outside 1..8 names the variable."""
    monkeypatch.delenv(cl.BLOCKS_ENV, raising=False)
    monkeypatch.delenv(cl.VARIANT_ENV, raising=False)
    # 35B-A3B o_proj: 1024 units of 2 rows, 8 warps a block; 27B o_proj / down: 2560 units
    assert cl.BLOCKS_PER_SM["bf16"] == 1
    assert {k: cl.route(2048, 4096, 1, "bf16", SM)[k] for k in ("kernel", "ks", "grid")} == \
        {"kernel": "gemv_bf16_t1", "ks": 2, "grid": (256,)}
    assert cl.route(5120, 17408, 2, "bf16", SM)["ks"] == 1 and cl.route(5120, 6144, 1, "bf16", SM)["grid"] == (320,)
    r = cl.route(2048, 4096, 1, "fp8_row", SM)
    assert r["kernel"] == "gemv_fp8row_t1" and r["ks"] == 8                  # 4 per SM: 1024 blocks
    for per_sm, ks in (("1", 2), ("2", 4), ("4", 8)):
        monkeypatch.setenv(cl.BLOCKS_ENV, per_sm)
        for kind in ("bf16", "fp8_row"):
            r = cl.route(2048, 4096, 1, kind, SM)
            assert r["ks"] == ks and r["grid"][0] * (cl.WARPS // ks) >= 1024 and r["grid"][0] >= int(per_sm) * SM
    monkeypatch.setenv(cl.BLOCKS_ENV, "9")
    with pytest.raises(KernelError, match=cl.BLOCKS_ENV):
        cl.route(2048, 4096, 1, "bf16", SM)
