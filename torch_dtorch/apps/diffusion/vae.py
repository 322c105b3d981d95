"""The VAE decode on the mesh (``ExecuteConfig(vae_parallel=True)``): the decoder replicated on every device, the
decode's batch — the images, or with tiling (``vae_tiling=True``) every tile of every image — sharded over all of
them.

A decoder is a stack of convolutions with 3x3 windows, group norms over whole feature maps and a spatial
self-attention: none of it splits along height or width without halos and feature-map-wide reductions. Its batch
splits for free, though (every op is per sample: the batch-sharded decoder runs without a single collective), and
tiling turns one image into a batch: diffusers' tiled decode cuts the latents into overlapping tiles
(``tile_latent_min_size``, overlap ``tile_overlap_factor``), decodes each one by itself and blends the seams. Here
the same tiles, grouped by shape (the last row and column of tiles can be shorter), are stacked along the batch,
decoded on the mesh with the batch sharded over every device, brought back to the host and blended exactly as
diffusers does — so the image equals diffusers' ``enable_tiling()`` decode.

When it pays: FLUX's and SD3's VAEs tile at their ``sample_size`` (1024 px), so a 1024x1024 image is one tile
unless ``vae.tile_sample_min_size = 512`` and ``vae.tile_latent_min_size = 64`` are set; it is then 3x3 tiles (four
512x512, four 512x256 / 256x512, one 256x256: 1.56x the pixels of one decode, the price of the overlaps). The
first device of the mesh gets a tile of each shape group, so the decode takes 0.81x of one untiled decode on 2 or
3 devices and 0.56x on 4 or more (1.56x with tiling on one device, which bounds memory only). Without tiling only a
batch of several images splits. The text encoders stay on the host device: they run once per prompt (not per
step) over at most 512 tokens, and their batch is one prompt — nothing to split.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torch_dtorch as dt
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, Shard

__all__ = ["MeshDecoder", "decode_on_mesh"]

log = logging.getLogger(__name__)


def _replicate(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """A copy of ``module`` with every parameter and buffer replicated on ``mesh``."""
    module = copy.deepcopy(module).eval()
    for name, p in list(module.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        placed = dt.distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim)
        owner.register_parameter(leaf, nn.Parameter(placed, False))
    for name, b in list(module.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        owner.register_buffer(leaf, dt.distribute_tensor(b, mesh, [Replicate()] * mesh.ndim))
    return module


class MeshDecoder:
    """``vae``'s decoder (and ``post_quant_conv``) replicated on ``mesh``; :meth:`decode` is a drop-in for the
    VAE's ``_decode`` (module docstring)."""

    def __init__(self, vae: Any, mesh: DeviceMesh) -> None:
        self.vae = vae
        self.mesh = mesh
        self.decoder = _replicate(vae.decoder, mesh)
        pqc = getattr(vae, "post_quant_conv", None)
        self.post_quant_conv = _replicate(pqc, mesh) if pqc is not None else None
        self.batch: list[Placement] = [Shard(0)] * mesh.ndim  # the batch over every device

    def _run(self, z: torch.Tensor) -> torch.Tensor:
        """Decode a batch on the mesh (issued, not waited for): the dtorch result."""
        x = dt.distribute_tensor(z.contiguous(), self.mesh, self.batch)
        with torch.no_grad():
            if self.post_quant_conv is not None:
                x = self.post_quant_conv(x)
            return self.decoder(x)

    def _tiles(self, z: torch.Tensor) -> list[list[torch.Tensor]]:
        """Every tile of ``z``, decoded on the mesh: diffusers' tiles, grouped by shape into one batch each."""
        vae = self.vae
        size = vae.tile_latent_min_size
        overlap = int(size * (1 - vae.tile_overlap_factor))
        starts = [(i, j) for i in range(0, z.shape[2], overlap) for j in range(0, z.shape[3], overlap)]
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, j in starts:
            shape = tuple(z[:, :, i : i + size, j : j + size].shape)
            groups.setdefault(shape, []).append((i, j))
        issued = []
        for where in groups.values():  # issue every group before fetching any: the devices never wait
            batch = torch.cat([z[:, :, i : i + size, j : j + size] for i, j in where])
            issued.append((where, self._run(batch)))
        decoded: dict[tuple[int, int], torch.Tensor] = {}
        b = z.shape[0]
        for where, out in issued:
            host = out.full_tensor()  # type: ignore[attr-defined]
            for k, ij in enumerate(where):
                decoded[ij] = host[k * b : (k + 1) * b]
        rows_at = sorted({i for i, _ in starts})
        cols_at = sorted({j for _, j in starts})
        return [[decoded[(i, j)] for j in cols_at] for i in rows_at]

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> Any:
        """``AutoencoderKL._decode`` on the mesh: tiled (diffusers' tiles and blending) when the VAE's tiling is on
        and the latents exceed one tile, else the whole batch."""
        from diffusers.models.autoencoders.vae import DecoderOutput

        vae = self.vae
        size = vae.tile_latent_min_size
        if getattr(vae, "use_tiling", False) and (z.shape[-1] > size or z.shape[-2] > size):
            dec = self._blend(self._tiles(z))
        else:
            dec = self._run(z).full_tensor()  # type: ignore[attr-defined]
        return DecoderOutput(sample=dec) if return_dict else (dec,)

    def _blend(self, rows: list[list[torch.Tensor]]) -> torch.Tensor:
        """diffusers' ``tiled_decode`` blending of decoded tiles (the VAE's own ``blend_v`` / ``blend_h``)."""
        vae = self.vae
        blend_extent = int(vae.tile_sample_min_size * vae.tile_overlap_factor)
        row_limit = vae.tile_sample_min_size - blend_extent
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = vae.blend_v(rows[i - 1][j], tile, blend_extent)
                if j > 0:
                    tile = vae.blend_h(row[j - 1], tile, blend_extent)
                result_row.append(tile[:, :, :row_limit, :row_limit])
            result_rows.append(torch.cat(result_row, dim=3))
        return torch.cat(result_rows, dim=2)


def decode_on_mesh(vae: Any, mesh: DeviceMesh) -> MeshDecoder:
    """Make ``vae`` decode on ``mesh`` (in place: its ``_decode`` becomes :meth:`MeshDecoder.decode`; encoding
    stays on the host); returns the :class:`MeshDecoder`."""
    decoder = MeshDecoder(vae, mesh)
    fn: Callable[..., Any] = functools.partial(MeshDecoder.decode, decoder)
    vae._decode = fn
    vae._dtorch_decoder = decoder
    log.info(
        "VAE decode on mesh %s (batch and tiles sharded over %d devices)", tuple(mesh.shape), mesh.size()
    )
    return decoder
