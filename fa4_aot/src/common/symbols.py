"""The cubin symbols of the kernels.

The DSL names each ``@cute.kernel`` after its function, ``str()`` of the object it is a
method of, and its arguments' types. ptxas's machine code depends on that name (seen: the
same PTX under another name gave other register choices), so a kernel class returns a
fixed stem from ``__str__``: a source file can move, or its class be renamed, and every
cubin stays byte-identical. A stem changes only with a deliberate rename, measured on the
GPU like any other change of generated code (docs/design.md, "Kernel symbols").
"""

# The stems the kernels have had since their first release (the module paths they were
# first written in); the manifest records the whole symbols.
FORWARD_SM90 = "<fa4_aot.src.fwd_sm90.FlashFwdSm90 object at >"
BACKWARD_SM90 = "<fa4_aot.src.bwd_sm90.FlashBwdSm90 object at >"
BACKWARD_ROWS_SM90 = "<fa4_aot.src.bwd_rows_sm90.BwdRowsSm90 object at >"
