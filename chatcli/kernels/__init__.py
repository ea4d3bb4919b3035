"""The C kernels: decode-step and sampling code in C, built for this CPU at first use.

Owns the shipped C sources beside this file, compiling them with the system's C compiler into
a per-user cache, loading them with ctypes, and the Python wrappers that call them. Imports
torch and the standard library only: no other chatcli layer, so the model and the engine can
both use it. Every kernel has a torch path beside it and says why it is unavailable.
"""
