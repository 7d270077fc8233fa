"""Drift probes are drawn on the factor's device and estimate the exact drift without bias."""

from __future__ import annotations

import torch

from asteria_client.runtime.refresh import DeviceGenerators, estimate_drift


def _exact(factor: torch.Tensor, basis: torch.Tensor) -> float:
    rotated = basis.T @ factor @ basis
    off = rotated.square().sum() - rotated.diagonal().square().sum()
    return float(off / factor.square().sum())


def test_the_probe_estimate_is_unbiased_and_its_columns_uniform() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 12
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    factor = a @ a.T
    basis = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    draws = DeviceGenerators(5).on(factor.device)
    estimates = torch.stack([estimate_drift(factor, basis, draws, probes=3) for _ in range(4000)])
    assert abs(float(estimates.mean()) - _exact(factor, basis)) < 0.03 * _exact(factor, basis)
    # each column is drawn with probability k/n: the plain-identity estimate sees them all
    seen = torch.zeros(n)
    keys = DeviceGenerators(6).on(factor.device)
    for _ in range(3000):
        seen[torch.rand(n, generator=keys).topk(3, sorted=False).indices] += 1
    assert torch.allclose(seen / 3000, torch.full((n,), 3 / n), atol=0.04)


def test_generators_are_per_device_and_seeded_alike() -> None:
    gens = DeviceGenerators(7)
    cpu = torch.device("cpu")
    assert gens.on(cpu) is gens.on(cpu)
    assert gens.on(cpu).device == cpu
    first = torch.rand(4, generator=DeviceGenerators(7).on(cpu))
    assert torch.equal(first, torch.rand(4, generator=DeviceGenerators(7).on(cpu)))
