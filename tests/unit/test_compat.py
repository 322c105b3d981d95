"""The compatibility module's own helpers."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from torch_dtorch import _compat


def _device_modes() -> int:
    from torch.utils._device import DeviceContext

    return sum(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def test_default_device_mode_off_removes_and_restores_the_mode() -> None:
    result: dict[str, object] = {}

    def worker() -> None:  # a thread of its own: the default device is thread-local
        torch.set_default_device("meta")
        try:
            result["before"] = (_device_modes(), torch.empty(1).device.type)
            with _compat.default_device_mode_off():
                result["inside"] = (_device_modes(), torch.empty(1).device.type)
            result["after"] = (_device_modes(), torch.empty(1).device.type)
            with pytest.raises(ValueError), _compat.default_device_mode_off():
                raise ValueError("boom")
            result["after error"] = (_device_modes(), torch.empty(1).device.type)
        finally:
            torch.set_default_device(None)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == {
        "before": (1, "meta"),
        "inside": (0, "cpu"),
        "after": (1, "meta"),
        "after error": (1, "meta"),
    }
    # without a default device it does nothing
    with _compat.default_device_mode_off():
        assert _device_modes() == 0
