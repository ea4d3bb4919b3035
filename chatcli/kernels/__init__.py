"""The C kernels: decode-step and sampling code in C, built for this CPU at first use.

Owns the shipped C sources beside this file; build.py compiles them with the system's C
compiler into a per-user cache, loads them with ctypes and keeps why a kernel is
unavailable; a module a kernel wraps and checks it (f16_matvec.py, f16_rows.py,
rows_step.py with its torch reference in rows_step_reference.py, sample_rows.py), over the
weight layouts of panels.py. Imports torch and the standard library only: no other chatcli
layer, so the model and the engine can both use it. Every kernel has a torch path beside it.
"""
