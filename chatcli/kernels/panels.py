"""The weight layouts our kernels read: matrices packed in panels of columns.

Owns: pack_panels (an (in, out) matrix's columns in panels, each contiguous), HalfPanels (an
fp16 matrix so packed: f16_rows and rows_step read a compact copy's own panels) and
Int8Panels (int8 codes so packed, their column scales in front), and the int8 rounding
(int8_rows). Knows nothing about the kernels that read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_panels(matrix: torch.Tensor, block: int) -> torch.Tensor:
    """An (in, out) matrix as rows_step's products read it: its columns in panels of
    `block`, each panel's (in, block) contiguous, then the remaining out % block columns
    as one (in, out % block) panel; flat."""
    n_in, out = matrix.shape
    whole = out // block * block
    panels = matrix[:, :whole].reshape(n_in, out // block, block).transpose(0, 1)
    return torch.cat([panels.reshape(-1), matrix[:, whole:].reshape(-1)])


@dataclass(frozen=True)
class HalfPanels:
    """An fp16 (in, out) matrix packed in panels of `panel` columns (pack_panels), the
    layout f16_rows reads (F16Rows.pack), so that rows_step reads a compact copy's own
    panels and no second copy is made."""

    panels: torch.Tensor  # flat fp16
    n_in: int
    n_out: int
    panel: int

    @classmethod
    def of(cls, matrix: torch.Tensor, panel: int) -> HalfPanels:
        """An (in, out) matrix's fp16 panels."""
        half = matrix.detach().to(torch.float16)
        return cls(pack_panels(half, panel), matrix.size(0), matrix.size(1), panel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_in, self.n_out

    def matrix(self) -> torch.Tensor:
        """The (in, out) matrix unpacked to fp32 (for references; whole panels only)."""
        blocks = self.panels.view(self.n_out // self.panel, self.n_in, self.panel)
        return blocks.transpose(0, 1).reshape(self.n_in, self.n_out).float()


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes (N, K) and fp32 scales (N,): row i is codes[i] * scales[i]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


@dataclass(frozen=True)
class Int8Panels:
    """An int8 (in, out) matrix as rows_step and rows_int8_product read it: one flat int8
    buffer of the `out` fp32 column scales (their bytes) then the codes packed in panels of
    `panel` columns (pack_panels); column j is codes[:, j] * scales[j] (int8_rows of the
    (out, in) weight). One buffer, so the step's structs keep one pointer a matrix."""

    buffer: torch.Tensor  # flat int8
    n_in: int
    n_out: int
    panel: int

    @classmethod
    def of(cls, codes: torch.Tensor, scales: torch.Tensor, panel: int) -> Int8Panels:
        """From int8_rows' codes (out, in) and scales (out,); out whole panels."""
        n_out, n_in = codes.shape
        if n_out % panel:
            raise ValueError(f"int8 panels need whole panels of {panel} columns, not {n_out}")
        scale_bytes = scales.float().contiguous().view(torch.int8)
        return cls(torch.cat([scale_bytes, pack_panels(codes.t(), panel)]), n_in, n_out, panel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_in, self.n_out

    @property
    def scales(self) -> torch.Tensor:
        return self.buffer[: 4 * self.n_out].view(torch.float32)

    def matrix(self) -> torch.Tensor:
        """The (in, out) matrix the codes and scales stand for, fp32 (for references)."""
        codes = self.buffer[4 * self.n_out :].view(self.n_out // self.panel, self.n_in, self.panel)
        return codes.transpose(0, 1).reshape(self.n_in, self.n_out).float() * self.scales


Matrix = torch.Tensor | HalfPanels | Int8Panels  # what rows_step reads a layer's matrix as
