"""Lazy conjugate / negative bits: ``torch.conj`` and ``_neg_view`` on dtorch tensors give torch's values.

PyTorch implements them as views carrying a bit on the tensor; on the storage-less controller tensor that bit would
never reach the workers (``fft.ifft`` and friends returned conjugated values). The device sends them to the
workers instead (``placement_rules/pointwise.py``, ``lazy_bit_view``).
"""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_DEVICE, init_mesh
from torch_dtorch import Replicate, Shard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _z(*shape: int) -> torch.Tensor:
    # drawn on the CPU (the generator's device), then moved to the suite's device (a GPU in the CUDA run)
    z = torch.randn(*shape, dtype=torch.complex64, generator=torch.Generator().manual_seed(5), device="cpu")
    return z.to(TEST_DEVICE)


@pytest.mark.parametrize("shape", [(1,), (3,)], ids=["1", "3"])
def test_conj_and_neg_view_values(shape: tuple[int, ...]) -> None:
    mesh = init_mesh(shape)
    z = _z(7, 4)
    for placements in ([Replicate()], [Shard(0)], [Shard(1)]):
        x = dt.distribute_tensor(z, mesh, placements)
        c = torch.conj(x)
        assert not c.is_conj()  # the bit lives on the workers' shards, never on the controller's tensor
        assert c.placements == x.placements
        assert torch.equal(c.full_tensor().resolve_conj(), z.conj().resolve_conj())
        assert torch.equal(torch._neg_view(x).full_tensor().resolve_neg(), -z)
        # consumers of the view: a matmul, a redistribute, an FFT
        torch.testing.assert_close((c @ c.T).full_tensor(), z.conj() @ z.conj().T)
        assert torch.equal(
            c.redistribute(mesh, [Shard(1)]).full_tensor().resolve_conj(), z.conj().resolve_conj()
        )
    x = dt.distribute_tensor(z, mesh, [Replicate()])
    torch.testing.assert_close(torch.fft.ifft(x).full_tensor(), torch.fft.ifft(z))
    r = z.real.contiguous()
    torch.testing.assert_close(
        torch.fft.ihfft(dt.distribute_tensor(r, mesh, [Replicate()])).full_tensor(), torch.fft.ihfft(r)
    )


def test_writes_through_a_conj_view_reach_the_base() -> None:
    mesh = init_mesh((3,))
    z = _z(7, 4)
    x = dt.distribute_tensor(z.clone(), mesh, [Shard(0)])
    want = z.clone()
    x.conj().mul_(2j)
    want.conj().mul_(2j)
    torch.testing.assert_close(x.full_tensor(), want)
