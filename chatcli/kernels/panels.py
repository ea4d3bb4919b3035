"""The weight layouts our kernels read: matrices packed in panels of columns.

Owns: pack_panels (an (in, out) matrix's columns in panels, each contiguous), HalfPanels (an
fp16 matrix so packed: f16_rows and rows_step read a compact copy's own panels),
Int8Panels (int8 codes so packed, their column scales in front), Int4Panels (int4 codes
in groups beside their fp16 scales and lows), and the int8 and int4 roundings (int8_rows,
int4_groups). Knows nothing about the kernels that read them.
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
    buffer of the `out` fp32 column scales (their bytes) then the codes in panels of
    `panel` columns; column j is codes[:, j] * scales[j] (int8_rows of the (out, in)
    weight). One buffer, so the step's structs keep one pointer a matrix.

    interleave 1: each panel (in, panel) codes, an input's `panel` codes a row (pack_panels),
    which the widening loop reads. interleave 4: each panel (ceil(in / 4), panel, 4), a
    column's codes of four inputs side by side and each + 128 (as unsigned bytes; inputs
    past `in` code 0), which integer dot products read (rows_int8_interleave() says which
    one this CPU's kernel takes)."""

    buffer: torch.Tensor  # flat int8
    n_in: int
    n_out: int
    panel: int
    interleave: int = 1

    @classmethod
    def of(
        cls, codes: torch.Tensor, scales: torch.Tensor, panel: int, interleave: int = 1
    ) -> Int8Panels:
        """From int8_rows' codes (out, in) and scales (out,); out whole panels."""
        n_out, n_in = codes.shape
        if n_out % panel:
            raise ValueError(f"int8 panels need whole panels of {panel} columns, not {n_out}")
        if interleave not in (1, 4):
            raise ValueError(f"int8 panels interleave 1 or 4 inputs, not {interleave}")
        scale_bytes = scales.float().contiguous().view(torch.int8)
        if interleave == 1:
            packed = pack_panels(codes.t(), panel)
        else:
            groups = -(-n_in // 4)
            padded = torch.zeros(n_out, 4 * groups, dtype=torch.int16)
            padded[:, :n_in] = codes
            biased = (padded + 128).to(torch.uint8).view(torch.int8)
            # (out, groups, 4) -> (out / panel, groups, panel, 4)
            packed = biased.view(n_out // panel, panel, groups, 4).permute(0, 2, 1, 3)
            packed = packed.reshape(-1)
        return cls(torch.cat([scale_bytes, packed]), n_in, n_out, panel, interleave)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_in, self.n_out

    @property
    def scales(self) -> torch.Tensor:
        return self.buffer[: 4 * self.n_out].view(torch.float32)

    def codes(self) -> torch.Tensor:
        """The (in, out) int8 codes, whichever the layout."""
        packed = self.buffer[4 * self.n_out :]
        panels = self.n_out // self.panel
        if self.interleave == 1:
            codes = packed.view(panels, self.n_in, self.panel).transpose(0, 1)
            return codes.reshape(self.n_in, self.n_out)
        groups = -(-self.n_in // 4)
        biased = packed.view(torch.uint8).view(panels, groups, self.panel, 4)
        codes = (biased.to(torch.int16) - 128).to(torch.int8).permute(1, 3, 0, 2)
        return codes.reshape(4 * groups, self.n_out)[: self.n_in]

    def matrix(self) -> torch.Tensor:
        """The (in, out) matrix the codes and scales stand for, fp32 (for references)."""
        return self.codes().float() * self.scales


INT4_GROUP = 128  # inputs a scale and low end of an int4 copy cover (decode_ops.c's INT4_GROUP)


def int4_groups(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of an (out, in) weight, in a multiple of `group`: codes (out, in)
    uint8 0-15, scales and lows (out, in / group) fp32; weight ~ low + code * scale."""
    w = weight.detach().float()
    n_out, n_in = w.shape
    groups = w.view(n_out, n_in // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return codes.view(n_out, n_in).to(torch.uint8), scales, low


@dataclass(frozen=True)
class Int4Panels:
    """An int4 (in, out) matrix as rows_step and rows_int4_product read it: panels of
    `panel` columns, each its groups of INT4_GROUP inputs one after another, a group the
    panel's `panel` fp16 scales, its `panel` fp16 low ends, then 16 pairs of quads (4
    inputs), (panel, 4) codes a quad: quad t's in the low nibbles, quad t + 16's in the
    high ones. Column j of group g is low[g, j] + code * scale[g, j] (int4_groups, the
    scales and lows rounded to fp16)."""

    buffer: torch.Tensor  # flat uint8
    n_in: int
    n_out: int
    panel: int

    @classmethod
    def of(cls, weight: torch.Tensor, panel: int) -> Int4Panels:
        """An (out, in) weight's int4 panels; out whole panels, in whole groups, its groups'
        scales and lows within fp16's range (a ValueError otherwise)."""
        n_out, n_in = weight.shape
        if n_out % panel or n_in % INT4_GROUP:
            raise ValueError(
                f"int4 panels need whole panels of {panel} columns and groups of"
                f" {INT4_GROUP} inputs, not {n_out} and {n_in}"
            )
        codes, scales, lows = int4_groups(weight)
        if max(scales.abs().max().item(), lows.abs().max().item()) > 65504:
            raise ValueError("int4 panels keep scales in fp16: this weight is past its range")
        P, G = n_out // panel, n_in // INT4_GROUP
        # codes (out, in) -> (P, panel, G, half, quad, 4) -> (P, G, quad, panel, 4)
        q = codes.view(P, panel, G, 2, 16, 4)
        nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
        nibbles = nibbles.reshape(P, G, 16 * panel * 4)

        def meta(t: torch.Tensor) -> torch.Tensor:  # (out, G) -> (P, G, panel fp16 bytes)
            half = t.to(torch.float16).view(P, panel, G).transpose(1, 2).contiguous()
            return half.view(torch.uint8).view(P, G, 2 * panel)

        buffer = torch.cat([meta(scales), meta(lows), nibbles], dim=2).reshape(-1)
        return cls(buffer, n_in, n_out, panel)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_in, self.n_out

    def matrix(self) -> torch.Tensor:
        """The (in, out) matrix the codes, scales and lows stand for, fp32 (for references)."""
        P, G, p = self.n_out // self.panel, self.n_in // INT4_GROUP, self.panel
        groups = self.buffer.view(P, G, 4 * p + 64 * p)
        scales = groups[..., : 2 * p].contiguous().view(torch.float16).float()  # (P, G, p)
        lows = groups[..., 2 * p : 4 * p].contiguous().view(torch.float16).float()
        nibbles = groups[..., 4 * p :].reshape(P, G, 16, p, 4)
        codes = torch.stack([nibbles & 15, nibbles >> 4], dim=2)  # (P, G, 2, 16, p, 4)
        codes = codes.permute(1, 2, 3, 5, 0, 4).reshape(G, INT4_GROUP, P * p).float()
        scales = scales.permute(1, 0, 2).reshape(G, 1, P * p)
        lows = lows.permute(1, 0, 2).reshape(G, 1, P * p)
        return (lows + codes * scales).reshape(self.n_in, self.n_out)


Matrix = torch.Tensor | HalfPanels | Int8Panels | Int4Panels  # how rows_step reads a matrix
