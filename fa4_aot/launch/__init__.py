"""The launch layer: what every front door (fa4_aot.dense, varlen, decode) launches
through, and nothing above it. The manifest and its rules (``manifest``, ``rules``,
``workspace``), the driver and its tensor maps (``driver``, ``tma``), the loaded kernels,
their parameter packing and kept launches (``loader``), arrays from any framework and
their checks (``arrays``, ``checks``), and the steps every call shares (``calls``)."""
