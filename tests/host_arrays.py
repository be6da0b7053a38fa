"""A host store of numpy arrays for offload tests on a CPU: memory the meter does not see, as
device memory does not see pinned host memory. Streams and copy times need a GPU."""

from __future__ import annotations

import numpy as np
import torch


class ArrayHost:
    def __init__(self) -> None:
        self.copied_out = 0

    def copy_out(self, data: torch.Tensor) -> np.ndarray:
        self.copied_out += data.numel()
        return data.numpy().copy()

    def wait_out(self) -> None:
        pass

    def copy_in(self, host: np.ndarray, device: torch.device) -> tuple[torch.Tensor, None]:
        data = torch.empty(host.size, dtype=torch.uint8, device=device)
        return data.copy_(torch.from_numpy(host)), None

    def wait_in(self, token: None) -> None:
        pass
