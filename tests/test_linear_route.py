"""The decode linear route table (kernels/cuda_linear.route), which needs no GPU: which kernel and
how many launches each column count gets, per weight kind."""

import pytest

from kernels import cuda_linear as cl

SM = 132


@pytest.mark.parametrize("kind,tag", [("fp8_row", "fp8row"), ("fp8_block", "fp8blk"), ("nvfp4", "nvfp4")])
def test_quantised_columns_go_to_the_tensor_core_kernels(kind, tag):
    for T, suffix in ((2, ""), (8, ""), (9, "16"), (16, "16"), (17, "32"), (32, "32")):
        r = cl.route(5120, 5120, T, kind, SM)
        assert r["path"] == "gemv" and r["kernel"] == f"gemv_{tag}_tc{suffix}", (T, r)
        assert r["nt"] >= T
    assert cl.launch_columns(kind, 5120) == 32
    for T in (33, 64):                                 # two launches of the 32-column kernel
        assert cl.route(5120, 5120, T, kind, SM)["kernel"] == f"gemv_{tag}_tc32"
    assert cl.route(5120, 5120, 65, kind, SM)["path"] == "dequant_matmul"


def test_small_single_column_layers_keep_the_cuda_core_kernel():
    # 48 rows = 3 tiles: too few blocks for the tensor-core kernel at T = 1
    assert cl.route(48, 5120, 1, "fp8_row", SM)["kernel"] == "gemv_fp8row_t1"
    assert cl.route(48, 5120, 2, "fp8_row", SM)["kernel"] == "gemv_fp8row_tc"


def test_nvfp4_with_odd_half_groups_uses_16_column_launches():
    assert cl.launch_columns("nvfp4", 1040) == 16
    for T in (1, 9, 16, 40):
        assert cl.route(77, 1040, T, "nvfp4", SM)["kernel"] == "gemv_nvfp4h_t16"


def test_bf16_beyond_two_columns_goes_to_cublas():
    assert cl.route(5120, 5120, 2, "bf16", SM)["kernel"] == "gemv_bf16_t2"
    assert cl.route(5120, 5120, 3, "bf16", SM)["path"] == "dequant_matmul"


def test_every_routed_kernel_exists_in_the_source():
    src = (cl.L.CUDA_DIR / "gemv.cu").read_text()
    for kind in ("bf16", "fp8_row", "fp8_block", "nvfp4"):
        for I in (5120, 1040):
            for T in range(1, cl.GEMV_COLUMNS[kind] + 1):
                for O in (48, 5120):
                    r = cl.route(O, I, T, kind, SM)
                    assert f" {r['kernel']}(" in src or f"({r['kernel']}," in src, r["kernel"]
