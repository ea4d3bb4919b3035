"""A fast path, or a plain one for good once the fast one fails: the one such wrapper.

Owns: running `fast` until it raises, then warning once and running `plain` from then on
(torch.compile's compiled forward before the eager one; a CUDA graph's decode step before
the module's forward). Knows nothing about what either path computes; the caller says which
errors are its own rather than the fast path's (they pass through and keep it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

R = TypeVar("R")


class Fallback(Generic[R]):
    """Callable as `fast`, until it fails: then `plain`, for good.

    The first failure is reported as a warning ("{what} failed, running eagerly: ...").
    `passes`: the exception types that are the caller's (a full cache's ValueError), not the
    fast path's failing: they are raised as they are and the fast path is kept.
    """

    def __init__(
        self,
        fast: Callable[..., R],
        plain: Callable[..., R],
        what: str,
        passes: tuple[type[Exception], ...] = (),
    ) -> None:
        self.fast: Callable[..., R] | None = fast
        self.plain = plain
        self.what = what
        self.passes = passes

    @property
    def current(self) -> Callable[..., R]:
        """The path the next call takes."""
        return self.plain if self.fast is None else self.fast

    def __call__(self, *args: object, **kwargs: object) -> R:
        return self.run(lambda path: path(*args, **kwargs))

    def run(self, use: Callable[[Callable[..., R]], R]) -> R:
        """use(fast), until it fails; then use(plain). For paths that are objects with more
        than one way in (a decode step's __call__ and its step_rows)."""
        if self.fast is not None:
            try:
                return use(self.fast)
            except self.passes:
                raise
            except Exception as e:  # the fast path fails in many types; the plain one works
                warnings.warn(f"{self.what} failed, running eagerly: {e}", stacklevel=3)
                self.fast = None
        return use(self.plain)


def compiled_or_eager(fn: Callable[..., R], **options: object) -> Fallback[R]:
    """fn through torch.compile (with `options`), fn itself for good if compiling or running
    the compiled code fails (no C compiler, an unsupported op). Inductor caches its kernels
    on disk, so only the first run on a machine pays the whole compile time."""
    return Fallback(torch.compile(fn, **options), fn, "torch.compile")
