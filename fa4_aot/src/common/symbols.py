"""The stems of the cubins' kernel names.

The DSL names each ``@cute.kernel`` after its function, ``str()`` of the object it is a
method of, and its arguments' types; and ptxas's machine code depends on that name (seen:
the same PTX under another name gave other register choices). So each kernel class
returns a fixed stem from ``__str__``, and moving a file or renaming a class changes no
cubin. The stems are frozen strings, not references: the first three read like the
module paths the kernels were first written in, which no longer exist. A stem changes only
by a deliberate rename, measured on the GPU like any other change of generated code
(docs/design.md, "Kernel symbols"); the manifest records the whole symbols.
"""

FORWARD_SM90 = "<fa4_aot.src.fwd_sm90.FlashFwdSm90 object at >"  # fwd/kernel.py
BACKWARD_SM90 = "<fa4_aot.src.bwd_sm90.FlashBwdSm90 object at >"  # bwd/kernel.py
PRE_POST_SM90 = "<fa4_aot.src.bwd_rows_sm90.BwdRowsSm90 object at >"  # bwd/pre_post.py
DECODE_SM90 = "fa4_aot_decode_sm90"  # decode/kernel.py
COMBINE_SM90 = "fa4_aot_combine_sm90"  # decode/combine.py
