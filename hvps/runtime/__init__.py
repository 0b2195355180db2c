"""The running job: ``init``/``shutdown``, topology, the engine thread that joins the control and
data planes, process sets and autotuning."""
