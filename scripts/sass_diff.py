"""Per-kernel SASS comparison of two builds of one translation unit.

    python3 scripts/sass_diff.py BEFORE.o AFTER.o [--cuobjdump PATH] [--markdown]

Disassembles both files with `cuobjdump -sass` (PATH from --cuobjdump, else $CUOBJDUMP,
else `cuobjdump` on PATH; the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels
provide both tools) and compares every kernel's instructions after dropping what does
not belong to the code: the /*addr*/ comments and any line-info lines. A kernel is
"identical" when its instruction text is; "identical, encoding too" when the 128-bit
encodings (which hold the scheduling control bits) match as well. Kernels present in
only one file are reported as such.

Prints one row per kernel (demangled name without the dsv4:: prefix and the parameter
list, instruction counts before and after, the result). Exit status 0 when every
kernel is in both files with identical instructions, 1 otherwise.

A change to the shared device helpers (csrc/common, docs/design.md section 4) must leave
every kernel "identical" unless it means to change code: compile the TU at both commits
with the same flags (setup.py's), then run this on the two objects.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")
# "/*0040*/   IADD3 R0, R2, 0x1800000, RZ ;   /* 0x0180000002007810 */"
_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
# the second encoding word, on a line of its own
_ENC = re.compile(r"^\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")


@dataclass
class Kernel:
    name: str
    instrs: list[str] = field(default_factory=list)
    encodings: list[str] = field(default_factory=list)


def canonical_name(mangled: str) -> str:
    """nvcc names an anonymous namespace per compilation (`_GLOBAL__N__<hash>_<file>_<hash>_<n>`,
    length-prefixed); the standard `_GLOBAL__N_1` in its place lets two builds match."""
    out, pos = [], 0
    for m in re.finditer(r"(\d+)_GLOBAL__N_", mangled):
        if m.start() < pos:
            continue
        end = m.start() + len(m.group(1)) + int(m.group(1))
        out += [mangled[pos:m.start()], "12_GLOBAL__N_1"]
        pos = end
    return "".join(out) + mangled[pos:]


def parse_sass(text: str) -> dict[str, Kernel]:
    """Kernels of a `cuobjdump -sass` listing, by mangled name (canonical_name), in file order."""
    kernels: dict[str, Kernel] = {}
    cur: Kernel | None = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = canonical_name(m.group(1))
            if name in kernels:
                raise ValueError(f"function {name} appears twice in one listing")
            cur = kernels[name] = Kernel(name)
            continue
        if cur is None or line.lstrip().startswith("//"):  # line info, e.g. "//## File ..., line 12"
            continue
        m = _INSTR.match(line)
        if m:
            cur.instrs.append(" ".join(m.group(1).split()))
            cur.encodings.append(m.group(2))
            continue
        m = _ENC.match(line)
        if m and cur.encodings:
            cur.encodings[-1] += m.group(1)
    return kernels


def compare(before: dict[str, Kernel], after: dict[str, Kernel]) -> list[tuple[str, int | None, int | None, str]]:
    """(mangled name, instructions before, after, result) per kernel, before's order first."""
    rows = []
    for name in list(before) + [n for n in after if n not in before]:
        b, a = before.get(name), after.get(name)
        if b is None or a is None:
            rows.append((name, len(b.instrs) if b else None, len(a.instrs) if a else None,
                         "only after" if b is None else "only before"))
        elif b.instrs != a.instrs:
            first = next((i for i, (x, y) in enumerate(zip(b.instrs, a.instrs)) if x != y),
                         min(len(b.instrs), len(a.instrs)))
            rows.append((name, len(b.instrs), len(a.instrs), f"DIFFERENT from instruction {first}"))
        elif b.encodings != a.encodings:
            rows.append((name, len(b.instrs), len(a.instrs), "identical instructions, control bits differ"))
        else:
            rows.append((name, len(b.instrs), len(a.instrs), "identical, encoding too"))
    return rows


def short_name(mangled: str) -> str:
    """`void dsv4::moe::k<8, true>(dsv4::moe::MoeParams)` -> `moe::k<8, true>`."""
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        return mangled
    name = subprocess.run([cxxfilt, mangled], capture_output=True, text=True, check=True).stdout.strip()
    if name.startswith("void "):
        name = name[5:]
    if name.endswith(")"):  # cut the parameter list: the "(" that matches the last ")"
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return name.removeprefix("dsv4::")


def disassemble(path: str, cuobjdump: str) -> str:
    if not os.path.isfile(path):
        raise SystemExit(f"sass_diff: {path} is not a file")
    out = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"sass_diff: {cuobjdump} -sass {path} failed: {out.stderr.strip()}")
    return out.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    p.add_argument("--markdown", action="store_true", help="a markdown table instead of aligned columns")
    args = p.parse_args(argv)
    if not args.cuobjdump:
        p.error("no cuobjdump: pass --cuobjdump PATH or set CUOBJDUMP (pip install nvidia-cuda-cuobjdump "
                "nvidia-cuda-nvdisasm)")
    before = parse_sass(disassemble(args.before, args.cuobjdump))
    after = parse_sass(disassemble(args.after, args.cuobjdump))
    if not before and not after:
        raise SystemExit(f"sass_diff: no kernels in {args.before} or {args.after}")
    rows = [(short_name(n), b, a, r) for n, b, a, r in compare(before, after)]
    cell = lambda v: "-" if v is None else str(v)  # noqa: E731
    if args.markdown:
        print("| kernel | instructions before | after | result |")
        print("| --- | ---: | ---: | --- |")
        for n, b, a, r in rows:
            print(f"| `{n}` | {cell(b)} | {cell(a)} | {r} |")
    else:
        w = max(len(n) for n, *_ in rows)
        for n, b, a, r in rows:
            print(f"{n:<{w}}  {cell(b):>7}  {cell(a):>7}  {r}")
    same = sum(r.startswith("identical") for *_, r in rows)
    print(f"{same} of {len(rows)} kernels identical")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
