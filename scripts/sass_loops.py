"""The hot loops of compiled kernels, from their SASS (no GPU needed): for each kernel whose
name matches, its instruction count, registers and stack, spill instructions, and each loop that
issues tensor-core MMAs (HGMMA) with its length and opcode mix per 64 MUFU (an exponential a
score, so loops of different tile shapes compare per unit of work; ncu_source.py gives the same
normalisation for executed instructions on the GPU).

    python torch_flash/_build.py --export-objects OBJ --hdims 128
    python scripts/sass_loops.py OBJ/attention_bwd_sm90_hdim128.cu.o --kernel 'FmhaKernelTma.*bfloat16' [--top 12]

cuobjdump comes from the CUDA toolkit on PATH or from Triton's bundled copy.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections import Counter

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)([^;]*);")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(bundled):
        return bundled
    raise SystemExit("cuobjdump not found (CUDA toolkit or Triton's bundled copy)")


def kernels(path: str) -> dict[str, list[tuple[int, str, str]]]:
    """{kernel name: [(address, opcode, operands)]} of an object file."""
    return parse(subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout)


def parse(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """{kernel name: [(address, opcode, operands)]} from cuobjdump -sass's text."""
    out: dict[str, list] = {}
    name = None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            out[name] = []
        elif name and (m := INSTRUCTION.match(line)):
            out[name].append((int(m.group(1), 16), m.group(2), m.group(4)))
    return out


def resources(path: str) -> dict[str, str]:
    """{kernel name: 'REG:n STACK:m'} from cuobjdump -res-usage."""
    text = subprocess.run([cuobjdump(), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"Function (\S+):\s*\n\s*(REG:\d+ STACK:\d+)", text)
    return dict(found)


def mma_loops(ins: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The bodies of the backward branches whose range holds an HGMMA, innermost (shortest) first."""
    at = {a: i for i, (a, _, _) in enumerate(ins)}
    loops = []
    for i, (a, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < a and int(target.group(1), 16) in at:
            body = ins[at[int(target.group(1), 16)]:i + 1]
            if any(o == "HGMMA" for _, o, _ in body):
                loops.append(body)
    return sorted(loops, key=len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("objects", nargs="+", help="object files or cubins")
    ap.add_argument("--kernel", default=".", help="a regex on the (mangled) kernel name")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed a loop")
    ap.add_argument("--loops", type=int, default=2, help="loops listed a kernel, shortest first")
    ap.add_argument("--tags", default=r"CausalBottomRight|NoMask|Residual|Grouped|Alibi|bfloat16_t|half_t|Paired|Persistent",
                    help="a regex whose matches in the mangled name label each kernel")
    args = ap.parse_args()
    for path in args.objects:
        res = resources(path)
        for name, ins in kernels(path).items():
            if not re.search(args.kernel, name):
                continue
            spills = sum(op in ("LDL", "STL") for _, op, _ in ins)
            tags = " ".join(dict.fromkeys(re.findall(args.tags, name))) or name[:80]
            print(f"{os.path.basename(path)} [{tags}]: {len(ins)} instructions, {res.get(name, '?')}, "
                  f"{spills} spill instructions")
            for body in mma_loops(ins)[:args.loops]:
                ops = Counter(op for _, op, _ in body)
                mufu = ops.get("MUFU", 0)
                scale = 64 / mufu if mufu else 1
                unit = "per 64 MUFU" if mufu else "(no MUFU: raw counts)"
                mix = ", ".join(f"{op} {n * scale:.0f}" for op, n in ops.most_common(args.top))
                print(f"  loop {body[0][0]:#x}-{body[-1][0]:#x}: {len(body)} instructions, "
                      f"{len(body) * scale:.0f} {unit}: {mix}")


if __name__ == "__main__":
    main()
