"""The torch stand-ins of _stand_ins.py (used by the forward and metadata tests)
against vLLM's own Triton helpers, run by Triton's CPU interpreter on the same
inputs: a mixed batch with a padding token, an empty request, a fresh prompt and a
long context; every helper's output must be equal, element for element.

The comparison runs in a child process (_interpret_child.py: the interpreter has to
be switched on before vLLM defines its kernels); conftest.py starts it as soon as
this test is collected, so it overlaps the other tests.
"""

from __future__ import annotations


def test_stand_ins_equal_vllms_triton_helpers(interpret_child):
    rc, out = interpret_child
    assert rc == 0, f"_interpret_child.py exited with {rc}:\n{out[-4000:]}"
    assert "all stand-ins match" in out, out[-4000:]
