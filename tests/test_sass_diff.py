"""scripts/sass_diff.py: per-kernel SASS comparison, on synthetic cuobjdump listings."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "sass_diff.py")


@pytest.fixture(scope="module")
def sd():
    spec = importlib.util.spec_from_file_location("sass_diff", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sass_diff"] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


def listing(functions: dict[str, list[tuple[str, str, str]]], base: int = 0) -> str:
    """A cuobjdump -sass listing: per function, (instruction, encoding word 1, word 2)."""
    out = ["", "Fatbin elf code:", "================", "arch = sm_90a", "", "\tcode for sm_90a"]
    for name, instrs in functions.items():
        out += [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
        for i, (ins, e1, e2) in enumerate(instrs):
            out.append(f"        /*{base + 16 * i:04x}*/                   {ins} ;    /* {e1} */")
            out.append(f"                                                 /* {e2} */")
        out.append("\t\t..........")
    return "\n".join(out) + "\n"


K = "_ZN4dsv44testILi8EEEvNS_6ParamsE"
A = [("LDC R1, c[0x0][0x28]", "0x00000a00ff017b82", "0x000fe20000000800"),
     ("IADD3 R0, R2, 0x1, RZ", "0x0000000102007810", "0x004fc80007ffe0ff"),
     ("EXIT", "0x000000000000794d", "0x000fea0003800000")]


def test_parse_keeps_instructions_and_both_encoding_words(sd):
    k = sd.parse_sass(listing({K: A}))[K]
    assert k.instrs == ["LDC R1, c[0x0][0x28]", "IADD3 R0, R2, 0x1, RZ", "EXIT"]
    assert k.encodings[1] == "0x00000001020078100x004fc80007ffe0ff"


def test_addresses_and_line_info_do_not_count(sd):
    before = sd.parse_sass(listing({K: A}))
    with_info = listing({K: A}, base=0x400).replace("\t\tFunction : " + K,
                                                    "\t\tFunction : " + K + '\n\t//## File "x.cu", line 7')
    after = sd.parse_sass(with_info)
    assert sd.compare(before, after) == [(K, 3, 3, "identical, encoding too")]


def test_control_bits_instruction_and_missing_kernels(sd):
    before = sd.parse_sass(listing({K: A, "only_b": A[:1]}))
    stall = [A[0], (A[1][0], A[1][1], "0x001fc80007ffe0ff"), A[2]]
    assert sd.compare(before, sd.parse_sass(listing({K: stall, "only_b": A[:1]})))[0][3] == (
        "identical instructions, control bits differ")
    changed = [A[0], ("IADD3 R0, R2, 0x2, RZ",) + A[1][1:], A[2]]
    rows = sd.compare(before, sd.parse_sass(listing({K: changed, "only_a": A})))
    assert rows == [(K, 3, 3, "DIFFERENT from instruction 1"), ("only_b", 1, None, "only before"),
                    ("only_a", None, 3, "only after")]
    shorter = sd.compare(before, sd.parse_sass(listing({K: A[:2], "only_b": A[:1]})))
    assert shorter[0] == (K, 3, 2, "DIFFERENT from instruction 2")


@pytest.mark.skipif(sys.platform != "linux", reason="a shell-script cuobjdump stand-in needs Linux")
def test_main_exit_status(sd, tmp_path, capsys):
    (tmp_path / "a.o").write_text(listing({K: A}))
    (tmp_path / "b.o").write_text(listing({K: A[:2]}))
    fake = tmp_path / "cuobjdump"
    fake.write_text('#!/bin/sh\n[ "$1" = -sass ] && cat "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    args = ["--cuobjdump", str(fake)]
    assert sd.main([str(tmp_path / "a.o"), str(tmp_path / "a.o"), *args]) == 0
    assert "1 of 1 kernels identical" in capsys.readouterr().out
    assert sd.main([str(tmp_path / "a.o"), str(tmp_path / "b.o"), "--markdown", *args]) == 1
    out = capsys.readouterr().out
    assert "| 3 | 2 | DIFFERENT from instruction 2 |" in out and "0 of 1 kernels identical" in out


def test_anonymous_namespace_names_match_across_builds(sd):
    """nvcc hashes each compilation into an anonymous namespace's name (the length prefix
    changes with it); both builds' names map to the standard one."""
    a = "_ZN4dsv47testing52_GLOBAL__N__351b5b95_14_poison_smem_cu_de2956a7_766627poison_shared_memory_kernelEji"
    b = "_ZN4dsv47testing53_GLOBAL__N__1bd19586_14_poison_smem_cu_7f9db02b_1392627poison_shared_memory_kernelEji"
    want = "_ZN4dsv47testing12_GLOBAL__N_127poison_shared_memory_kernelEji"
    assert sd.canonical_name(a) == sd.canonical_name(b) == want
    assert sd.canonical_name(K) == K
    assert sd.compare(sd.parse_sass(listing({a: A})), sd.parse_sass(listing({b: A}))) == [
        (want, 3, 3, "identical, encoding too")]
